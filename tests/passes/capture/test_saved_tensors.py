"""Saved-tensor analysis: what the meta-device run says autograd keeps equals what a real CPU run
keeps (``saved_tensors_hooks``, unique storages, parameters / buffers / inputs excluded)."""
import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.capture.saved import SAVED, saved_info, saved_status
from autoshard.passes.graph import outputs

from autoshard.testing import models


def _captured(name):
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.BUILDERS[name]()
    return model, inputs, target, capture(model, inputs, loss_fn=loss_fn, target=target)


def _measured_saved_bytes(model, inputs, target, cg) -> int:
    """Run the captured program for real and add up the storages autograd packs."""
    args = [*model.parameters(), *model.buffers(),
            *(inputs.values() if isinstance(inputs, dict) else inputs), target]
    placeholders = {t.untyped_storage().data_ptr() for t in args}
    packed = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in placeholders:
            packed[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cg.gm(*args)
    assert loss.requires_grad
    return sum(packed.values())


def _estimated_saved_bytes(cg) -> int:
    info = saved_info(cg)
    total = 0
    for n in cg.gm.graph.nodes:
        if n.op == "call_function":
            i = info[n.name]
            total += sum(outputs(n)[s].nbytes for s in i.saved_outputs) + i.internal_bytes
    return total


@pytest.mark.parametrize("name", ["gpt", "hf_llama", "cnn", "mlp"])
def test_meta_analysis_equals_the_bytes_a_real_run_saves(name):
    model, inputs, target, cg = _captured(name)
    estimated = _estimated_saved_bytes(cg)
    assert saved_status(cg) == "ok"
    assert estimated > 0
    assert estimated == _measured_saved_bytes(model, inputs, target, cg)


def test_views_own_nothing_and_pass_saves_to_their_operand():
    _, _, _, cg = _captured("gpt")
    info = saved_info(cg)
    nodes = {n.name: n for n in cg.gm.graph.nodes}
    # q/k/v projections are read by attention through a view and a transpose: the views own no
    # storage, the projections' outputs are saved, and each view saves its operand "through" them
    for name, i in info.items():
        n = nodes[name]
        if n.op == "call_function" and n.target == torch.ops.aten.transpose.int:
            assert i.alias_of is not None and i.saved_outputs == ()
            if i.saved_operands:  # transposes feeding attention
                assert info[i.alias_of[0]].output_saved
    sdpa = [i for n, i in info.items() if "scaled_dot_product" in str(nodes[n].target)]
    assert sdpa and all(i.saved_operands == (0, 1, 2) and i.output_saved for i in sdpa)
    # the attention keeps its log-sum-exp (internal), and selective checkpointing its output + lse
    assert all(i.internal_bytes > 0 and i.selective_bytes > outputs(nodes[n])[0].nbytes
               for n, i in info.items() if "scaled_dot_product" in str(nodes[n].target))
    # the last linear of a block feeds only the residual add: nothing keeps its output
    residual_adds = [n for n in nodes.values() if n.target == torch.ops.aten.add.Tensor]
    fed = {a.name for n in residual_adds for a in n.all_input_nodes if a.target == torch.ops.aten.linear.default}
    assert fed and not any(info[name].output_saved for name in fed)
    assert all(SAVED in nodes[name].meta for name in info)


def test_a_program_the_meta_device_cannot_run_falls_back_and_says_why(monkeypatch):
    """An op without a meta kernel (simulated: the attention kernel raising) leaves no analysis;
    the cost model then keeps every op output that is not a view, as it did before it existed."""
    from autoshard.passes.capture import saved
    from autoshard.passes.cost.facts import GraphFacts
    from autoshard.passes.cost.hardware import PRESETS

    def no_meta_kernel(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::fused' with arguments from the 'Meta' backend")

    monkeypatch.setattr(saved, "fused_attention", no_meta_kernel)
    _, _, _, cg = _captured("gpt")
    assert saved_info(cg) is None
    assert saved_status(cg).startswith("NotImplementedError: Could not run")
    facts = GraphFacts(cg, PRESETS["h100"])
    assert facts.saved is None and facts.operand_saved("linear", 0)
