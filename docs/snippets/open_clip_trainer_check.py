"""open_clip's own trainer (open_clip_train.main, unmodified) on a tiny real image-text
set, with open_clip's loss or ours; records every loss call to <mode>.json.

    python open_clip_trainer_check.py data                  # 128 PNGs + train.csv
    python open_clip_trainer_check.py MODE [open_clip_train.main's flags]

MODE: ``reference`` (open_clip's loss), ``ours`` (``install()``), ``svr``
(``install(svr={"radius": "dynamic"})``; also prints how far the radius predictor's
parameters moved). Needs open_clip_torch[training] and its torchvision; the tiny model
config ``cl-tiny`` is registered from this folder's ``cl-tiny.json``, which ``data`` writes.
"""

import copy
import csv
import json
import random
import sys
from pathlib import Path

CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32,
                   "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2,
                 "layers": 2},
}  # fmt: skip


def make_data() -> None:
    """128 coloured shapes on white, 64x64 PNG, with their captions (tab-separated CSV)."""
    from PIL import Image, ImageDraw

    random.seed(0)
    colours = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220),
               "yellow": (230, 210, 40)}  # fmt: skip
    shapes = ["circle", "square", "triangle", "cross"]
    out = Path("images")
    out.mkdir(exist_ok=True)
    rows = []
    for i in range(128):
        colour, shape = random.choice(list(colours)), random.choice(shapes)
        img = Image.new("RGB", (64, 64), (245, 245, 245))
        draw, fill = ImageDraw.Draw(img), colours[colour]
        x, y, r = random.randint(16, 48), random.randint(16, 48), random.randint(8, 14)
        if shape == "circle":
            draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        elif shape == "square":
            draw.rectangle([x - r, y - r, x + r, y + r], fill=fill)
        elif shape == "triangle":
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
        else:
            draw.rectangle([x - r, y - 3, x + r, y + 3], fill=fill)
            draw.rectangle([x - 3, y - r, x + 3, y + r], fill=fill)
        path = out / f"{i:03d}.png"
        img.save(path)
        caption = f"a {colour} {shape} on a white background"
        rows.append({"filepath": str(path.resolve()), "title": caption})
    with open("train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["filepath", "title"], delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    Path("cl-tiny.json").write_text(json.dumps(CONFIG))


def run(mode: str, argv: list[str]) -> None:
    import open_clip
    import open_clip_train.main as trainer

    open_clip.add_model_config(Path("cl-tiny.json").resolve())
    installed = start = None
    if mode != "reference":
        from contrastive_losses.integrations.open_clip_train import install

        installed = install(svr={"radius": "dynamic"} if mode == "svr" else None)
    record = []
    create_loss = trainer.create_loss

    def recording_create_loss(args):
        nonlocal start
        if installed is not None and installed.radius is not None:
            # the radius's initial values, drawn from --seed when the model was built
            start = copy.deepcopy(installed.radius.state_dict())
        loss = create_loss(args)
        forward = loss.forward

        def recorded(*a, **k):
            out = forward(*a, **k)
            record.append({key: value.item() for key, value in out.items()})
            return out

        loss.forward = recorded
        print("loss:", type(loss).__module__, type(loss).__name__)
        return loss

    trainer.create_loss = recording_create_loss
    trainer.main(argv)
    result = {"losses": record}
    if start is not None:
        (model,) = installed.models
        end = installed.radius.state_dict()
        result["radius_parameters"] = [
            n for n, _ in model.named_parameters() if n.startswith("contrastive_losses_svr")
        ]
        result["radius_change"] = {k: (end[k] - start[k]).abs().max().item() for k in end}
        result["radius_start"] = {k: v.flatten().tolist() for k, v in start.items()}
        print("radius parameters on the model:", result["radius_parameters"])
        print("max |change| per tensor:", result["radius_change"])
    Path(f"{mode}.json").write_text(json.dumps(result, indent=1))
    print(mode, "steps:", len(record), "first:", record[0], "last:", record[-1])


if __name__ == "__main__":
    if sys.argv[1] == "data":
        make_data()
    else:
        run(sys.argv[1], sys.argv[2:])
