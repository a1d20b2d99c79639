"""Train examples/moe_layer.py and the demo exactly and in quantized formats, and draw the loss curves.

Writes ``docs/results/wire_training.png`` and prints the tables that docs/wire.md
shows. Two gloo ranks on this machine. The MoE example checks itself (the
quantized losses within its ``LOSS_RTOL`` of the exact one-process losses); the
demo's run is ``python -m funcoll.demo --wire``'s, against its one-process reference::

    python docs/build_wire_training.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from funcoll import _demo_train as train
from funcoll import demo
from funcoll.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "wire_training.png"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("moe_layer", ROOT / "examples" / "moe_layer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _table(title: str, exact: list[float], quantized: list[float]) -> None:
    steps = range(1, len(exact) + 1)
    drift = max(abs(a - b) / abs(b) for a, b in zip(quantized, exact, strict=True))
    print(f"{title}: largest drift {drift:.2%}")
    print("| step | " + " | ".join(map(str, steps)) + " |")
    print("|---|" + "---:|" * len(exact))
    print("| exact | " + " | ".join(f"{v:.3f}" for v in exact) + " |")
    print("| quantized | " + " | ".join(f"{v:.3f}" for v in quantized) + " |")


def main() -> int:
    mod = _example()
    world = 2
    moe_exact = run_ranks(mod.run, world, "aot_eager", "exact", timeout=300)[0]["losses"]
    moe_quantized = run_ranks(mod.run, world, "aot_eager", "quantized", timeout=300)[0]["losses"]
    cfg = train.Config(steps=30, wire=True)
    demo_quantized = run_ranks(demo._rank_runs, world, cfg, timeout=600)[0]["quantized"].losses
    demo_exact = train.reference(cfg, show=False).losses
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    panels = (
        (axes[0], f"examples/moe_layer.py, {world} ranks", moe_exact, moe_quantized,
         "int8 router gather, FP8 dispatch, BF16 combine"),
        (axes[1], f"python -m funcoll.demo --wire, {world} ranks", demo_exact, demo_quantized,
         "FP8 Ulysses all_to_alls, BF16 gradients"),
    )  # fmt: skip
    for ax, title, exact, quantized, label in panels:
        steps = list(range(1, len(exact) + 1))
        ax.plot(steps, exact, "o-", ms=3, label="exact (one process, float64)")
        ax.plot(steps, quantized, "s--", ms=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=100)
    _table("moe_layer", moe_exact, moe_quantized)
    _table("demo", demo_exact, demo_quantized)
    print(f"plot: {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
