"""The adapted token mixers at the sizes of transformers' default config of each family
(most copy a released model's): the units the SP degree must split, the degrees (ulysses
x ring, up to 64) that split them, the channels per token each layer's exchange carries,
and the GPU kernels the adapter calls where their packages are installed. Models are
built on the meta device (nothing is allocated). Prints a markdown table
(docs/reference/families.md, "Mixers at real proportions").

    python scripts/mixer_degrees.py                       # every adapted family, ~10 s
    python scripts/mixer_degrees.py MambaConfig ZambaConfig
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ulysses_cp.models.hf_mixers import ADAPTERS, mixer_channels, mixer_degrees, mixer_reduced

# config class -> (the family, the kernels the adapter calls)
CONV = "causal-conv1d `causal_conv1d_fn`"
FAMILIES = {
    "Qwen3NextConfig": ("Qwen3-Next", f"{CONV}, fla `chunk_gated_delta_rule`"),
    "BambaConfig": ("Bamba", f"{CONV}, mamba-ssm `mamba_chunk_scan_combined`"),
    "NemotronHConfig": ("Nemotron-H", f"{CONV}, mamba-ssm `mamba_chunk_scan_combined`"),
    "FalconH1Config": ("Falcon-H1", f"{CONV}, mamba-ssm `mamba_chunk_scan_combined`"),
    "Mamba2Config": ("Mamba2", f"{CONV}, mamba-ssm `mamba_chunk_scan_combined`"),
    "Zamba2Config": ("Zamba2", f"{CONV}, mamba-ssm `mamba_chunk_scan_combined`"),
    "MambaConfig": ("Mamba", f"{CONV}, mamba-ssm `selective_scan_fn`"),
    "FalconMambaConfig": ("FalconMamba", f"{CONV}, mamba-ssm `selective_scan_fn`"),
    "JambaConfig": ("Jamba", f"{CONV}, mamba-ssm `selective_scan_fn`"),
    "ZambaConfig": ("Zamba", f"{CONV}, mamba-ssm `selective_scan_fn` (one per head)"),
    "KimiLinearConfig": ("Kimi Linear", f"{CONV}, fla `chunk_kda`"),
    "MiniMaxConfig": ("MiniMax", "none: the block recurrence in torch"),
}


def row(name: str) -> str:
    """The table row of one config class."""
    import transformers

    cfg = getattr(transformers, name)()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    module = next(m for m in model.modules() if type(m).__name__ in ADAPTERS)
    units = ADAPTERS[type(module).__name__][1](module)
    counts = ", ".join(f"{n} {what}" for what, n in units.items())
    to, back = mixer_channels(module, 1)
    reduced = mixer_reduced(module)
    exchange = f"{to} out, {back} back" + (f", {reduced} all-reduced" if reduced else "")
    family, kernels = FAMILIES[name]
    family = f"{family} (hidden {cfg.hidden_size})"
    degrees = ", ".join(map(str, mixer_degrees(units)))
    cells = [family, f"`{type(module).__name__}`", counts, degrees, exchange, kernels]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "families", nargs="*", help=f"config classes (default: all of {list(FAMILIES)})"
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    head = ["family (default config)", "mixer", "units", "SP degrees <= 64", "channels per token"]
    print("| " + " | ".join([*head, "GPU kernels"]) + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.families or FAMILIES:
        if name not in FAMILIES:
            raise SystemExit(f"{name}: not one of {list(FAMILIES)}")
        print(row(name))


if __name__ == "__main__":
    main()
