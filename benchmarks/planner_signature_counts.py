"""Issue 29's counts of how settings travel through the planners, over autoshard/ passes/ runtime/ (tests
and benchmarks left out):

- ``memory_limit=`` passed as a keyword in a call (ast: a def's parameter is not a call site; the
  grep line count, which also counts parameters and messages, is printed too);
- ``get_hardware(`` calls (its def left out);
- functions of autoshard/ and passes/ with more than 8 parameters (self/cls left out; *args and
  **kwargs count one each).

    python benchmarks/planner_signature_counts.py [ROOT]
"""
import ast, sys, pathlib, re
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
def files(dirs):
    for d in dirs:
        for p in sorted((root / d).rglob("*.py")):
            if "tests" in p.parts or "benchmarks" in p.parts: continue
            yield p
ml, gh, big = [], [], []
for p in files(["autoshard", "passes", "runtime"]):
    src = p.read_text(); tree = ast.parse(src)
    rel = p.relative_to(root)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "memory_limit":
                    ml.append(f"{rel}:{node.lineno}")
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == "get_hardware":
                gh.append(f"{rel}:{node.lineno}")
for p in files(["autoshard", "passes"]):
    tree = ast.parse(p.read_text()); rel = p.relative_to(root)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v] if x.arg not in ("self", "cls")]
            if len(names) > 8:
                big.append((len(names), f"{rel}:{node.lineno} {node.name}"))
grep = [l for l in __import__("subprocess").run(["grep", "-rn", "memory_limit=", "--include=*.py", "autoshard", "passes", "runtime"], cwd=root, capture_output=True, text=True).stdout.splitlines() if "/tests/" not in l]
print(f"grep 'memory_limit=' lines: {len(grep)}")
print(f"memory_limit= keyword in calls (ast): {len(ml)}"); [print("  ", x) for x in ml]
print(f"get_hardware( calls (ast): {len(gh)}"); [print("  ", x) for x in gh]
print(f"functions with >8 params: {len(big)}")
for n, x in sorted(big, reverse=True): print(f"   {n:3d} {x}")
