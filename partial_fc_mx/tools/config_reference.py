"""docs/configuration.md, generated from the Config class: every key with its type,
default and meaning, in the class's sections. The docs cannot drift from the code:
tests/test_docs.py compares the page with this module's output.

    python -m partial_fc_mx.tools.config_reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

from .. import config

HEADER = """# Configuration keys

Most people need: copy a shipped config (below) or write your own with the keys you
change; `_base_ = "orl.py"` starts from a shipped one. Every key, its type, default
and meaning is in the tables further down.

A config is a Python file of `key = value` lines (`configs/*.py`); `_base_ = "other.py"`
takes another's values first (found beside the config, then in `configs/`). The config
you name (`train CONFIG`, `check CONFIG`, `CONFIG=... bash config.sh`) is found the
same way: from the current folder, then in the repository, so `configs/ms1mv3_r50.py`
or `ms1mv3_r50.py` works from any folder (training says which file it took). And
`key=value` words on the command line override both (`python -m partial_fc_mx train
configs/orl.py batch_size=32`, `bash config.sh sample_rate=0.1`). Unknown keys (with a
did-you-mean) and values of the wrong type are errors, and so are values that would
fail later or on one rank only: `verbose`, `frequent`, `batch_size`, `lr` ... <= 0,
negative `max_steps`, `save_every` or `warmup_epoch`, a margin outside `m1 >= 1,
0 <= m2 < pi, 0 <= m3 < 2, scale > 0`, an unknown `network`, and (at start, on every
rank) a `sample_rate` that gives a process no center to sample.

Relative paths (the config file, `rec`, `output` or `--work-dir`, `HOSTFILE`) are taken
from the folder you launch from, by every entry point: `config.sh` and `run.sh` do not
change folder, and `run.sh` starts every process in it (`mpirun -wdir`; with horovodrun
or srun keep that folder on every host, or use absolute paths). A path that does not
exist is reported as the absolute path that was looked for. The work dir
defaults to `work_dirs/<config file name>` in that folder; a `val_targets` name `lfw`
is read from `<rec>/lfw.bin`.

**Config files are Python code**: loading one runs it, with your permissions. Use
only config files you trust, as you would any script. Data, checkpoints and
verification sets are never executed (training.md, evaluation.md).

| config | data (sample_rate) | network | loss |
|---|---|---|---|
| `orl.py` (default) | AT&T/ORL faces, 30 training identities | tiny | ArcFace |
| `ms1mv3_r50.py`, `ms1mv3_r100.py` | MS1MV3, 93,431 ids | r50, r100 | ArcFace |
| `ms1mv3_r50_cosface.py`, `ms1mv3_r50_adaface.py` | MS1MV3 | r50 | CosFace, AdaFace |
| `glint360k_r50.py`, `glint360k_r100.py` | Glint360K, 360,232 ids (0.1) | r50, r100 | CosFace |
| `glint360k_r100_arcface.py` | Glint360K (0.1) | r100 | ArcFace |
| `glint360k_r100_noisy.py` | Glint360K, noisy labels (0.1) | r100 | CosFace, 3 sub-centers |
| `webface4m_r50.py` | WebFace4M, 205,990 ids (0.3) | r50 | ArcFace |
| `webface42m_r100.py` | WebFace42M, 2,059,906 ids (0.2) | r100 | ArcFace |
| `webface42m_vit_t.py` | WebFace42M (0.3), AdamW | vit_t_dp005_mask0 | CosFace |
| `webface42m_vit_s.py` | WebFace42M (0.3), AdamW, 384 a GPU | vit_s_dp005_mask_0 | CosFace |
| `random_1m_r50.py`, `random_10m_r50.py` | random tensors, 1M / 10M ids (0.1) | r50 | ArcFace |
| `synthetic_sampling.py` | synthetic look-alike ids (docs/parity.md) | tiny | ArcFace |

Generated from `partial_fc_mx/config.py` by `python -m partial_fc_mx.tools.config_reference`.
"""


def sections() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """[(section, [(key, type, default, meaning), ...]), ...] in the class's order."""
    source = textwrap.dedent(inspect.getsource(config.Config))
    body = ast.parse(source).body[0].body
    lines = source.splitlines()
    found: list[tuple[str, list]] = [("keys", [])]
    previous_end = 0
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign):
            previous_end = getattr(node, "end_lineno", previous_end)
            continue
        between = lines[previous_end:node.lineno - 1]  # blank and comment lines above it
        previous_end = node.end_lineno
        for line in between:
            if heading := re.fullmatch(r"\s*# --- (.+) ---", line):
                found.append((heading.group(1), []))
        following = body[i + 1] if i + 1 < len(body) else None
        meaning = ""
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            meaning = " ".join(following.value.value.split())
        found[-1][1].append((node.target.id, ast.unparse(node.annotation),
                             default_of(node.value), meaning))
    return found


def default_of(value: ast.expr) -> str:
    """The default as written, or the value its default_factory makes."""
    if isinstance(value, ast.Call) and any(k.arg == "default_factory" for k in value.keywords):
        factory = next(k.value for k in value.keywords if k.arg == "default_factory")
        return {"list": "[]", "dict": "{}"}.get(ast.unparse(factory), ast.unparse(factory) + "()")
    return ast.unparse(value)


def cell(text: str) -> str:
    """Text for a Markdown table cell: its pipes escaped."""
    return text.replace("|", "\\|")


def render() -> str:
    parts = [HEADER]
    for section, keys in sections():
        if not keys:
            continue
        parts.append(f"\n## {section[0].upper()}{section[1:]}\n\n| key | type | default | "
                     "meaning |\n|---|---|---|---|")
        parts += [f"| `{key}` | {cell(kind)} | `{cell(default)}` | {cell(meaning)} |"
                  for key, kind, default, meaning in keys]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
