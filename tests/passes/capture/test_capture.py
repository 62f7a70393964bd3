"""The capture pass: placeholder order and maps, metadata on every node, module paths, runnable
programs equal to eager (loss, gradients, buffer updates), meta-device capture, HF models, the fx
fallback and the TraceError for untraceable code."""
from __future__ import annotations

import copy
import inspect
import operator
import resource

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.capture.export import capture, set_graph_device
from autoshard.passes.capture.normalize import DEVICE_KWARG
from autoshard.passes.errors import TraceError
from autoshard.passes.graph import META, MODULE, operands
from autoshard.passes.spec import TensorMeta
from autoshard.testing.models import BUILDERS, cnn, gpt, hf_gpt2, hf_llama, mlp

aten = torch.ops.aten


def build(name, **kw):
    torch.manual_seed(0)
    return BUILDERS[name](**kw)


def call_model(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def input_values(inputs):
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def placeholders(cg):
    return [n for n in cg.gm.graph.nodes if n.op == "placeholder"]


def run_captured(cg, model, inputs, target=None):
    """Run the program on the model's own tensors; buffers are cloned (the program updates them)."""
    params = [p for _, p in model.named_parameters()]
    buffers = [b.clone() for _, b in model.named_buffers()]
    extra = [target] if target is not None else []
    return cg.gm(*params, *buffers, *input_values(inputs), *extra), buffers


@pytest.fixture(scope="module")
def captured():
    """One CPU capture per shared test model (with its loss), reused by the read-only tests."""
    out = {}
    for name in BUILDERS:
        model, inputs, target, loss_fn = build(name)
        out[name] = (model, inputs, target, loss_fn, capture(model, inputs, loss_fn=loss_fn, target=target))
    return out


def test_placeholder_order_and_maps(captured):
    model, _, _, _, cg = captured["cnn"]
    names = [n.name for n in placeholders(cg)]
    assert names == list(cg.params) + list(cg.buffers) + cg.inputs + [cg.target]
    assert list(cg.params.values()) == [n for n, _ in model.named_parameters()]
    assert list(cg.buffers.values()) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert cg.inputs == ["x"] and cg.target == "target"
    assert cg.loss_output and cg.method == "export" and cg.aliases == {}
    for ph in placeholders(cg):
        assert ph.target == ph.name and ph.meta[MODULE] == ""


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_node_has_meta_and_module(captured, name):
    model, inputs, target, _, cg = captured[name]
    modules = {n for n, _ in model.named_modules()}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for node in cg.gm.graph.nodes:
        assert META in node.meta and MODULE in node.meta, node.name
        assert node.meta[MODULE] in modules, (node.name, node.meta[MODULE])
        if node.op == "call_function" and node.target is not operator.getitem:
            assert node.meta[META] is not None or node.target in (aten._assert_scalar.default,), node.name
    for ph, fqn in {**cg.params, **cg.buffers}.items():
        t = tensors[fqn]
        assert cg.node(ph).meta[META] == TensorMeta(tuple(t.shape), t.dtype)
    for ph, value in zip(cg.inputs + [cg.target], input_values(inputs) + [target]):
        assert cg.node(ph).meta[META] == TensorMeta(tuple(value.shape), value.dtype)
    loss = cg.output_node.args[0]
    assert isinstance(loss, torch.fx.Node) and loss.meta[META].shape == ()
    assert not any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in cg.gm.graph.nodes)
    assert not any(n.target is aten._assert_tensor_metadata.default for n in cg.gm.graph.nodes)


def test_module_paths(captured):
    def modules_of(cg, target):
        return {n.meta[MODULE] for n in cg.gm.graph.nodes if n.target == target}

    assert modules_of(captured["gpt"][4], aten.linear.default) == {
        f"blocks.{i}.{m}" for i in range(2) for m in ("q", "k", "v", "o", "fc", "out")} | {"head"}
    assert modules_of(captured["gpt"][4], aten.scaled_dot_product_attention.default) == {"blocks.0", "blocks.1"}
    assert modules_of(captured["cnn"][4], aten.batch_norm.default) == {"bn"}
    assert modules_of(captured["mlp"][4], aten.linear.default) == {"proj", "fc1", "fc2"}
    # the loss is computed by loss_fn outside the model: top level
    assert captured["gpt"][4].output_node.args[0].meta[MODULE] == ""
    llama = captured["hf_llama"][4]
    assert "model.layers.1.self_attn.q_proj" in modules_of(llama, aten.linear.default)
    assert any(m.startswith("model.rotary_emb") for m in modules_of(llama, aten.cos.default))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_runnable_program_equals_eager(captured, name):
    model, inputs, target, loss_fn, cg = captured[name]
    eager_model = copy.deepcopy(model)
    eager = loss_fn(call_model(eager_model, inputs), target)
    loss, buffers = run_captured(cg, model, inputs, target)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    eager_grads = torch.autograd.grad(eager, [p for _, p in eager_model.named_parameters()], allow_unused=True)
    for (fqn, _), g, e in zip(model.named_parameters(), grads, eager_grads):
        assert (g is None) == (e is None), fqn
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6, msg=fqn)
    for (fqn, b), got in zip(eager_model.named_buffers(), buffers):  # in-place updates (BatchNorm)
        torch.testing.assert_close(got, b, msg=fqn)


def test_capture_does_not_modify_the_model():
    model, inputs, target, loss_fn = build("cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {n: set(m.__dict__) for n, m in model.named_modules()}
    capture(model, inputs, loss_fn=loss_fn, target=target)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == attrs


def test_tied_weights_one_placeholder(captured):
    model, _, _, _, cg = captured["gpt"]
    assert model.head.weight is model.wte.weight
    assert cg.aliases == {"head.weight": "wte.weight"}
    assert "head.weight" not in cg.params.values() and list(cg.params.values()).count("wte.weight") == 1
    wte = next(ph for ph, fqn in cg.params.items() if fqn == "wte.weight")
    assert {u.target for u in cg.node(wte).users} == {aten.embedding.default, aten.linear.default}
    hf = captured["hf_gpt2"][4]
    assert hf.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert len(hf.params) == len(list(captured["hf_gpt2"][0].parameters()))


def test_parameter_used_twice(captured):
    _, _, _, _, cg = captured["mlp"]
    proj = next(ph for ph, fqn in cg.params.items() if fqn == "proj.weight")
    assert [u.target for u in cg.node(proj).users] == [aten.linear.default] * 2
    assert cg.inputs == ["x", "mask"]


def test_buffers_batchnorm_and_rotary(captured):
    cg = captured["cnn"][4]
    bn = next(n for n in cg.gm.graph.nodes if n.target == aten.batch_norm.default)
    assert [op.node.name for op in operands(bn)][3:] == ["b_bn_running_mean", "b_bn_running_var"]
    assert any(n.target == aten.add_.Tensor and n.args[0].name == "b_bn_num_batches_tracked"
               for n in cg.gm.graph.nodes)
    llama = captured["hf_llama"][4]
    assert "model.rotary_emb.inv_freq" in llama.buffers.values()  # non-persistent buffer


def test_unused_parameter_keeps_its_placeholder():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    cg = capture(M(), (torch.randn(8, 4),))
    assert list(cg.params.values()) == ["used.weight", "used.bias", "unused.weight", "unused.bias"]
    assert all(len(cg.node(ph).users) == 0 for ph, fqn in cg.params.items() if fqn.startswith("unused"))
    assert not cg.loss_output and isinstance(cg.output_node.args[0], torch.fx.Node)


def _metas(cg):
    return [(n.name, n.meta[META], n.meta[MODULE]) for n in cg.gm.graph.nodes]


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_meta_capture_matches_cpu_and_runs_after_set_graph_device(captured, name):
    with torch.device("meta"):
        model, inputs, target, loss_fn = build(name)
    cg = capture(model, inputs, loss_fn=loss_fn, target=target)
    assert all(p.is_meta for p in model.parameters())
    cpu_model, cpu_inputs, cpu_target, _, cpu_cg = captured[name]
    if name == "gpt":  # HF code branches on the device type (e.g. an extra .contiguous() off-CPU)
        assert _metas(cg) == _metas(cpu_cg)
    assert _metas(cg)[:len(placeholders(cg))] == _metas(cpu_cg)[:len(placeholders(cpu_cg))]
    marked = [n for n in cg.gm.graph.nodes if n.meta.get(DEVICE_KWARG)]
    assert any(n.target == aten.arange.default for n in marked)
    assert all(n.kwargs.get("device", torch.device("meta")).type == "meta" for n in marked)
    on_cpu = set_graph_device(cg.gm, "cpu")
    assert all(n.kwargs.get("device", torch.device("meta")).type == "meta" for n in marked)  # input untouched
    loss = on_cpu(*cpu_model.parameters(), *[b.clone() for b in cpu_model.buffers()],
                  *input_values(cpu_inputs), cpu_target)
    torch.testing.assert_close(loss, loss_fn(call_model(cpu_model, cpu_inputs), cpu_target))


def test_meta_capture_allocates_no_parameter_memory():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with torch.device("meta"):  # ~0.9 B parameters: 3.6 GB if materialized
        model, inputs, target, loss_fn = build("gpt", vocab=32000, d=2048, n_layer=16, n_head=16, seq=1024)
    cg = capture(model, inputs, loss_fn=loss_fn, target=target)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert all(p.is_meta for p in model.parameters())
    assert len(cg.params) == len(list(model.parameters())) and grown_mib < 1024, grown_mib


def test_hf_inputs_of_several_dtypes_and_labels():
    model, inputs, target, loss_fn = build("hf_gpt2")
    mask = torch.ones(8, 16)
    mask[:, :3] = 0.0
    kwargs = {"input_ids": inputs["input_ids"], "attention_mask": mask}
    cg = capture(model, kwargs, loss_fn=loss_fn, target=target)
    assert cg.inputs == ["input_ids", "attention_mask"]
    assert [cg.node(n).meta[META].dtype for n in cg.inputs] == [torch.int64, torch.float32]
    loss, _ = run_captured(cg, model, kwargs, target)
    torch.testing.assert_close(loss, loss_fn(model(**kwargs), target))
    # no loss_fn, labels given: the program returns HF's own .loss
    with_labels = {"input_ids": inputs["input_ids"], "labels": target}
    cg = capture(model, with_labels)
    assert cg.loss_output and cg.inputs == ["input_ids", "labels"] and cg.target is None
    torch.testing.assert_close(run_captured(cg, model, with_labels)[0], model(**with_labels).loss)


def test_outputs_without_loss_fn():
    model, inputs, _, _ = build("mlp")
    cg = capture(model, inputs)
    assert not cg.loss_output and cg.target is None
    torch.testing.assert_close(run_captured(cg, model, inputs)[0], model(*inputs))

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y, y.relu()

    cg = capture(Two(), (torch.randn(8, 4),))
    assert isinstance(cg.output_node.args[0], tuple) and len(cg.output_node.args[0]) == 2

    class Scalar(Two):
        def forward(self, x):
            return self.lin(x).pow(2).mean()

    assert capture(Scalar(), (torch.randn(8, 4),)).loss_output
    hf, hf_inputs, _, _ = build("hf_llama")
    cg = capture(hf, hf_inputs)  # an HF output without labels: its .logits
    assert not cg.loss_output and cg.output_node.args[0].meta[META].shape == (8, 16, 64)


class Counter(nn.Module):
    """Counts its calls in a buffer; the update must be part of the program."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


class LogsStatistics(Counter):
    """Records an activation statistic with ``.numpy()``: torch.export rejects it, fx drops it."""

    def forward(self, x):
        y = super().forward(x)
        self.last_mean = y.detach().abs().mean().numpy()
        return y


def test_fallback_to_symbolic_trace():
    model, x = LogsStatistics(), torch.randn(8, 4)
    cg = capture(model, (x,), loss_fn=lambda y, t: F.mse_loss(y, t), target=torch.zeros(8, 4))
    assert cg.method == "symbolic_trace"
    assert not hasattr(model, "last_mean") and model.calls.item() == 0  # the model is untouched
    assert list(cg.params.values()) == ["lin.weight", "lin.bias"] and list(cg.buffers.values()) == ["calls"]
    assert {n.target for n in cg.gm.graph.nodes} >= {aten.linear.default, aten.add_.Tensor}
    loss, (calls,) = run_captured(cg, model, (x,), torch.zeros(8, 4))
    torch.testing.assert_close(loss, F.mse_loss(model(x), torch.zeros(8, 4)))
    assert calls.item() == 1.0
    assert all(META in n.meta and MODULE in n.meta for n in cg.gm.graph.nodes)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y
        return -y


def test_trace_error_names_the_construct_and_line():
    with pytest.raises(TraceError) as info:
        capture(DataDependent(), (torch.randn(8, 4),))
    line = next(i for i, text in enumerate(inspect.getsourcelines(DataDependent.forward)[0])
                if "if y.sum() > 0" in text) + DataDependent.forward.__code__.co_firstlineno
    message = str(info.value)
    assert f"test_capture.py:{line}" in message and "if y.sum() > 0" in message
    assert "control flow" in message and "torch.where" in message


def test_bad_arguments_raise_trace_error():
    with pytest.raises(TraceError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))
    with pytest.raises(TraceError, match="separate"):
        capture(nn.Linear(2, 2), ([torch.randn(2, 2)],))
    with pytest.raises(TraceError, match="target must be a tensor"):
        capture(nn.Linear(2, 2), (torch.randn(2, 2),), loss_fn=F.mse_loss, target=[1.0])


def test_buffer_reassignment_and_no_grad_region():
    class Child(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            y = self.lin(x)
            self.ema = 0.9 * self.ema + 0.1 * y.mean(0).detach()
            with torch.no_grad():
                scale = self.lin.weight.abs().sum()
            return y * scale

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Child()

        def forward(self, x):
            return self.child(x).sum()

    torch.manual_seed(0)
    model, x = Parent(), torch.randn(8, 4)
    cg = capture(model, (x,))
    assert any(n.target == aten.copy_.default for n in cg.gm.graph.nodes)
    assert cg.loss_output and model.child.ema.abs().sum() == 0
    loss, (ema,) = run_captured(cg, model, (x,))
    eager_model = copy.deepcopy(model)
    eager = eager_model(x)
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(ema, eager_model.child.ema)
    (g,) = torch.autograd.grad(loss, [model.child.lin.weight])
    (e,) = torch.autograd.grad(eager, [eager_model.child.lin.weight])
    torch.testing.assert_close(g, e)  # no gradient through the no_grad scale


def test_a_no_grad_region_computed_from_parameters_builds_no_autograd_graph():
    """Spectral norm's power iteration runs under ``torch.no_grad`` from the weight and writes its ``_u``/``_v``
    buffers with ``out=``; inlined with grad on, the captured program raised (autograd refuses ``out=`` on a
    value that requires grad). Now it runs as eager: same loss, buffers and weight gradient."""
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    model = nn.Sequential(spectral_norm(nn.Linear(6, 5)), nn.Tanh(), spectral_norm(nn.Linear(5, 1))).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    eager_model = copy.deepcopy(model)
    cg = capture(model, (x,), loss_fn=lambda out, t: out.square().mean(), target=torch.zeros(8, 1, dtype=torch.float64))
    loss, buffers = run_captured(cg, model, (x,), torch.zeros(8, 1, dtype=torch.float64))
    eager = eager_model(x).square().mean()
    torch.testing.assert_close(loss, eager)
    for got, (_, want) in zip(buffers, eager_model.named_buffers()):
        torch.testing.assert_close(got, want)  # the power iteration's u and v, written in place
    weight = model[0].parametrizations.weight.original
    (g,) = torch.autograd.grad(loss, [weight])
    (e,) = torch.autograd.grad(eager, [eager_model[0].parametrizations.weight.original])
    torch.testing.assert_close(g, e)


def test_builders_are_meta_constructible_and_deterministic():
    for name in BUILDERS:
        with torch.device("meta"):
            model, inputs, target, _ = build(name)
        assert all(p.is_meta for p in model.parameters()) and target.is_meta
        a, b = build(name)[0], build(name)[0]
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        assert input_values(build(name)[1])[0].shape[0] == 8


def test_stack_traces_are_recorded_unless_only_priced():
    """``capture`` records each op's source line (fx shows it when a running node fails);
    ``stack_traces=False`` (what ``autoshard.plan`` traces with: a quarter of Llama-3 8B's trace CPU)
    records none and leaves the program the same, and fx's own setting as it was."""
    import torch.fx.config as fx_config

    from autoshard.api import plan
    from autoshard.plans import graph_fingerprint
    model, inputs, target, loss_fn = build("mlp")

    def lines(cg):
        return sum(bool(n.meta.get("stack_trace")) for n in cg.gm.graph.nodes if n.op == "call_function")

    with_lines = capture(model, inputs, loss_fn=loss_fn, target=target)
    without = capture(model, inputs, loss_fn=loss_fn, target=target, stack_traces=False)
    assert lines(with_lines) > 0 and lines(without) == 0
    assert graph_fingerprint(with_lines) == graph_fingerprint(without)
    assert fx_config.do_not_emit_stack_traces is False
    planned = plan(model, 2, example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu")
    assert lines(planned.captured) == 0
