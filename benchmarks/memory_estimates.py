"""Measured memory next to the plan's estimate, per lever: saved activations and gathered copies.

    python benchmarks/memory_estimates.py

The test models of ``autoshard.testing.levers`` (GPT with tied embeddings, HF Llama from a config, a
CNN with BatchNorm and dropout) on 4 gloo ranks under the layouts that gather their block weights
(ZeRO-3 on (4,), DP x Megatron TP on (2, 2)); for each lever case one step is measured by
``runtime.memory_probe`` (activation bytes autograd keeps at the end of the forward; parameter-copy
bytes alive at once, prefetches in flight included) and the same strategies and levers are priced
by ``solution.evaluate``. Prints a markdown table of rank 0's figures (every rank is checked by
``tests/runtime/test_memory_estimates.py``).
"""
from __future__ import annotations

import torch

from autoshard.testing.levers import MICRO, Probed, build, planned
from autoshard.testing.ranks import run_ranks

CASES = (("none", 1, "none", False), ("selective + reshard", 1, "selective", True), ("full", 1, "full", False),
         ("acc 2 + full + reshard", 2, "full", True), ("acc 4 + selective", 4, "selective", False),
         ("acc 2 + reshard", 2, "none", True))
MODELS = (("gpt", ((4,), (2, 2))), ("hf_llama", ((4,), (2, 2))), ("cnn", ((4,), (2, 2))))


def worker(rank: int, world: int) -> list:
    from autoshard.passes.capture.export import capture
    from autoshard.passes.levers import BlockPolicy, Levers
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    rows = []
    for model_name, meshes in MODELS:
        torch.manual_seed(0)
        model, batch, loss_fn, layers = build(model_name)
        inputs, target = batch(MICRO, 0)
        captured = capture(model, inputs, loss_fn=loss_fn, target=target)
        block_type = "model.layers.#" if model_name == "hf_llama" else "blocks.#"
        for mesh_shape in meshes:
            env = setup_distributed(Mesh.of(mesh_shape))
            strategies = planned(captured, model, mesh_shape, layers, rank, env)
            for case, k, checkpoint, reshard in CASES:
                levers = Levers(k, {block_type: BlockPolicy(checkpoint, reshard)})
                probed = Probed(RankProgram(captured, strategies, mesh_shape, env=env, model=model, levers=levers))
                x, y = batch(MICRO * k, 1)
                probed.step(**x, target=y) if isinstance(x, dict) else probed.step(*x, target=y)
                est = evaluate(captured, Mesh.of(mesh_shape), strategies, "cpu", "adamw", levers=levers,
                               traced_at_microbatch=True).estimated
                rows.append((model_name, str(mesh_shape), case, probed.measured["saved"],
                             est["saved_activation_bytes"], probed.measured["gathered"], est["gathered_peak_bytes"]))
    return rows


def main() -> None:
    rows = run_ranks(worker, 4, timeout=1200)[0]
    print("| model | mesh | levers | saved measured | saved estimated | gap | gathered peak measured "
          "| gathered estimated | gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, mesh, case, saved, saved_est, gathered, gathered_est in rows:
        print(f"| {model} | {mesh} | {case} | {saved:,} | {saved_est:,.0f} | {(saved - saved_est) / saved_est:+.1%} "
              f"| {gathered:,} | {gathered_est:,.0f} | {(gathered - gathered_est) / gathered_est:+.1%} |")


if __name__ == "__main__":
    main()
