"""Random-weight copies of a checkpoint pair, for a machine the checkpoints cannot be sent to.

Usage: python random_models.py SRC OUT  -- SRC holds target/ and draft/ folders, each a config.json
(the real checkpoint's) and the tokenizer's files; OUT gets the same folders with safetensors
weights drawn as the model class initializes them (seeded), in bfloat16. A pass costs what the
real model's costs (same shapes); what the models say is noise, so acceptance means nothing.
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(src: Path, out: Path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("target", "draft"):
        dest = out / name
        dest.mkdir(parents=True, exist_ok=True)
        for f in (src / name).iterdir():
            if f.name != "config.json":
                shutil.copy(f, dest / f.name)
        config = AutoConfig.from_pretrained(src / name)
        torch.manual_seed(1234)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(dest)
        params = sum(p.numel() for p in model.parameters())
        layers, hidden = config.num_hidden_layers, config.hidden_size
        sys.stdout.write(f"{name}: {layers} layers, hidden {hidden}, {params / 1e9:.2f} B params\n")
        del model


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
