"""``autoshard plan SPEC --layout L`` prices exactly that layout (the library's ``plan(layout=)``), and
``--compare L`` prints autoshard's plan and the layout side by side with the ratio of their steps."""
from __future__ import annotations

import json
import math

import autoshard
from autoshard import cli, layouts
from autoshard.model_specs import build_model
from autoshard.plans import load_plan

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": False}


def test_layout_flag_prices_the_layout_and_compare_prints_both(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    out = tmp_path / "layout.json"
    assert cli.main(["plan", str(config), "--mesh", "4", "--batch", "8", "--seq", "8", "--hardware", "h100",
                     "--out", str(out), "--layout", "megatron:tp=2,recompute=selective"]) == 0
    saved = load_plan(out)
    built = build_model(str(config), batch=8, seq=8)
    want = autoshard.plan(built.model, 4, example_inputs=built.example_inputs, loss_fn=built.loss_fn,
                          example_target=built.example_target, hardware="h100",
                          layout=layouts.megatron(tp=2, recompute="selective"))
    assert saved.mesh.shape == (2, 2)
    assert saved.param_placements == want.param_placements
    assert tuple(map(str, saved.param_placements["model.layers.0.self_attn.o_proj.weight"])) == ("R", "S(1)")
    assert math.isclose(saved.estimated_step_time, want.estimated_step_time, rel_tol=1e-9)
    capsys.readouterr()

    ours = tmp_path / "ours.json"
    assert cli.main(["plan", str(config), "--mesh", "4", "--batch", "8", "--seq", "8", "--hardware", "h100",
                     "--out", str(ours), "--compare", "megatron:tp=2,recompute=selective"]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("side by side"):].splitlines()
    assert table[1].split()[:3] == ["plan", "step", "(additive)"]
    mine, theirs = table[2].split(), table[3].split()
    assert mine[0] == "autoshard" and theirs[0] == "megatron:tp=2,recompute=selective"
    assert theirs[-3:] == ["1.000", "/", "1.000"]
    ratio = load_plan(ours).estimated_step_time / want.estimated_step_time
    assert float(mine[-3]) == round(ratio, 3)
