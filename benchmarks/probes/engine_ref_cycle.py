"""Probe: the reference cycles that keep an engine alive after its last reference is dropped.

tests/engine/test_engine_freed.py asserts that an engine dies with its last reference (with the
cyclic collector off). Where it fails, this prints each cycle through the engine as a path of
attribute names, found by a breadth-first search over gc.get_referents from the engine back to
itself, then removes that edge's owner from the search and looks again (up to --cycles paths).
Then it collects and says whether the engine went: one still alive is held by something outside
it, not by a cycle (H100 run 65's case under pytest, whose log capture kept a warning's record,
the exception in its arguments and through its traceback the engine; this script runs without
pytest, so such a holder shows only where a handler of its own keeps records).

    python3 benchmarks/probes/engine_ref_cycle.py [--device cuda] [--spec plain,adaptive]
"""
from __future__ import annotations

import argparse
import gc
import types
import weakref

SPECS = {
    "plain": None,
    "adaptive": {"method": "dspark", "enable_adaptive_verification": True},
}


def _edge_name(src, dst) -> str:
    """How src refers to dst: an attribute, a dict key, a list index, a closure cell."""
    if isinstance(src, dict):
        for k, v in src.items():
            if v is dst:
                return f"[{k!r}]"
            if k is dst:
                return "<key>"
    if isinstance(src, (list, tuple)):
        for i, v in enumerate(src):
            if v is dst:
                return f"[{i}]"
    if isinstance(src, types.CellType):
        return ".cell_contents"
    if isinstance(src, types.FunctionType):
        return f"<{src.__qualname__}>"
    if isinstance(src, types.MethodType):
        return f"<bound {src.__func__.__qualname__}>"
    d = getattr(src, "__dict__", None)
    if d is dst:
        return ".__dict__"
    if isinstance(d, dict):
        for k, v in d.items():
            if v is dst:
                return f".{k}"
    if hasattr(type(src), "__slots__"):
        for k in type(src).__slots__:
            if getattr(src, k, None) is dst:
                return f".{k}"
    return f"<{type(src).__name__}>"


def _label(o) -> str:
    t = type(o)
    name = getattr(o, "__qualname__", None) if isinstance(o, (types.FunctionType, type)) else None
    return f"{t.__module__}.{t.__qualname__}" + (f"({name})" if name else "")


def find_cycle(root, banned: set[int], max_depth: int = 14):
    """A shortest path root -> ... -> root over referents, avoiding the objects in banned."""
    parent = {id(root): None}  # (the objects stay alive during the search, so their ids stay theirs)
    frontier = [root]
    for _ in range(max_depth):
        nxt = []
        for o in frontier:
            for r in gc.get_referents(o):
                if r is root:
                    path = [r, o]
                    p = parent[id(o)]
                    while p is not None:
                        path.append(p)
                        p = parent[id(p)]
                    return list(reversed(path))
                if id(r) in parent or id(r) in banned or isinstance(r, (types.ModuleType, type, str, int, float)):
                    continue
                parent[id(r)] = o
                nxt.append(r)
        frontier = nxt
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spec", default="plain,adaptive")
    ap.add_argument("--cycles", type=int, default=6)
    a = ap.parse_args()
    names = a.spec.split(",")
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        ap.error(f"--spec: unknown engine kind(s) {', '.join(map(repr, unknown))}; choose from {', '.join(SPECS)}")
    from adaspec import LLM, SamplingParams
    for name in names:
        kw = dict(speculative_config=SPECS[name], device=a.device)
        LLM("tiny", **kw)
        gc.collect()
        gc.disable()
        llm = LLM("tiny", **kw)
        llm.generate(["def f(x):"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        ref = weakref.ref(llm.llm_engine)
        del llm
        eng = ref()
        print(f"== {name} on {a.device}: engine {'ALIVE' if eng is not None else 'freed'}")
        banned: set[int] = set()
        for i in range(a.cycles if eng is not None else 0):
            path = find_cycle(eng, banned)
            if path is None:
                print("  no more cycles within the search depth")
                break
            print(f"  cycle {i + 1}:")
            for src, dst in zip(path, path[1:]):
                print(f"    {_label(src)} {_edge_name(src, dst)} -> {_label(dst)}")
            banned.add(id(path[-2]))  # the object that points back at the engine
        del eng
        gc.enable()
        gc.collect()
        print(f"   after a collection: {'ALIVE (not a cycle: something global holds it)' if ref() is not None else 'freed'}")


if __name__ == "__main__":
    main()
