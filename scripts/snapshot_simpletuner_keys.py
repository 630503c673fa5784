"""Write tests/data/simpletuner_keys.json: every key of SimpleTuner's config dialect at one commit.

The dialect table (``simpletuner.configuration.simpletuner.translate.DIALECT``) must say something about
every key a SimpleTuner user may bring; a test checks the table against this snapshot. The snapshot
holds key names only (facts), read from SimpleTuner's own documentation and examples:

* ``top``: every ``--key`` documented in documentation/OPTIONS.md (its headings, its bold bullets, the
  ``--help`` listing at its end, the ``--key`` mentions in its prose, and the bare ``ltx2_*`` names of
  its "LTX-2 conditioning options" section), plus every key of config/config.json.example and of
  simpletuner/examples/*/config.json (with or without the leading ``--``).
* ``dataset``: every entry-level key documented in documentation/DATALOADER.md (its ``### `key```
  and ``#### `key``` headings and the keys of the dataset entries in its JSON examples, plus the few
  keys it documents only in prose, :data:`DATALOADER_PROSE_KEYS`), plus every entry-level key of the
  example dataloader configs: config/multidatabackend*.json.example and every JSON file under
  simpletuner/examples/ whose content is a list of dataset entries.
* ``dataset_nested``: ``block.key`` for the keys inside an entry's sub-objects (``video.num_frames``,
  ``huggingface.subset``...), from the same JSON plus DATALOADER.md's ``audio.*`` table. Informative:
  the dialect table covers ``top`` and ``dataset``.

Usage (the SimpleTuner checkout may be a bare clone; files are read with ``git show``)::

    python scripts/snapshot_simpletuner_keys.py --repo /path/to/SimpleTuner \\
        --commit bc8e6ab7738ce457a2ed8eb2d26cadd91c6442cb [--output tests/data/simpletuner_keys.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "tests" / "data" / "simpletuner_keys.json"
DEFAULT_COMMIT = "bc8e6ab7738ce457a2ed8eb2d26cadd91c6442cb"
REPO_NAME = "bghira/SimpleTuner"

OPTIONS_MD = "documentation/OPTIONS.md"
DATALOADER_MD = "documentation/DATALOADER.md"

#: ``--words`` in OPTIONS.md that are not keys of a training config: "the below ``--arguments``",
#: the ``simpletuner server --mode ... --kubeflow`` command line, accelerate's ``--multi_gpu``, argparse's help.
OPTIONS_NOT_KEYS = frozenset({"arguments", "help", "kubeflow", "mode", "multi_gpu"})

#: Entry-level keys DATALOADER.md documents only in running text (no heading, no JSON example):
#: the accepted spelling ``disable`` of ``disabled``, and the Webshart caption option with its alt spelling.
DATALOADER_PROSE_KEYS = ("disable", "webshart_optimise_captions", "webshart_optimize_captions")

#: A dict in a JSON example is a dataset entry when it has one of these keys (conditioning generator
#: blocks and bbox sidecars, also shown as JSON there, have none of them).
ENTRY_MARKERS = frozenset({"id", "dataset_type", "instance_data_dir"})

KEY = r"[a-z][a-z0-9_]*"
DASHED = re.compile(rf"(?<![\w-])--({KEY})(?![\w-])")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, encoding="utf-8"
    ).stdout


def lenient_json(text: str):
    """Parse JSON as written in docs and examples: trailing commas, ``...`` lines and ``#`` comments."""
    lines = [line for line in text.splitlines() if line.strip() not in ("...", "…")]
    text = "\n".join(re.sub(r"\s#\s.*$", "", line) for line in lines)
    return json.loads(re.sub(r",(\s*[}\]])", r"\1", text))


def options_keys(text: str) -> set[str]:
    lines = text.splitlines()
    keys = {key for key in DASHED.findall(text)}
    # The LTX-2 conditioning section names its keys without dashes ("set them in JSON ... with the names below").
    section = None
    for line in lines:
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif section == "LTX-2 conditioning options":
            keys |= set(re.findall(r"`((?:validation_)?ltx2_[a-z0-9_]+)`", line))
    return keys - OPTIONS_NOT_KEYS


def json_blocks(markdown: str):
    for match in re.finditer(r"```json\n(.*?)```", markdown, re.S):
        try:
            yield lenient_json(match.group(1))
        except ValueError:
            continue  # a fragment such as `"audio": {...}` or a JSON Lines sample: not an entry


def entries_of(data) -> list[dict]:
    items = data if isinstance(data, list) else [data]
    return [item for item in items if isinstance(item, dict) and ENTRY_MARKERS & set(item)]


def nested_keys(entry: dict) -> set[str]:
    out = set()
    for key, value in entry.items():
        blocks = value if isinstance(value, list) else [value]
        for block in blocks:
            if isinstance(block, dict):
                out |= {f"{key}.{sub}" for sub in block if re.fullmatch(KEY, sub)}
    return out


def dataloader_doc_keys(text: str) -> tuple[set[str], set[str]]:
    keys, nested = set(DATALOADER_PROSE_KEYS), set()
    for line in text.splitlines():
        heading = re.match(r"#{3,4} (.*)$", line)
        if heading:
            names = re.findall(r"`([^`]*)`", heading.group(1))
            rest = re.sub(r"`[^`]*`|/|\band\b", "", heading.group(1)).strip()
            if names and not rest and all(re.fullmatch(KEY, n) for n in names):
                keys |= set(names)
        nested |= set(re.findall(rf"^\| `({KEY}\.{KEY})` \|", line))
    for data in json_blocks(text):
        for entry in entries_of(data):
            keys |= set(entry)
            nested |= nested_keys(entry)
    return keys, nested


def config_keys(data: dict) -> set[str]:
    return {key[2:] if key.startswith("--") else key for key in data}


def snapshot(repo: Path, commit: str) -> dict:
    files = git(repo, "ls-tree", "-r", "--name-only", commit).splitlines()
    top_files = sorted(
        f
        for f in files
        if f == "config/config.json.example" or re.fullmatch(r"simpletuner/examples/[^/]+/config\.json", f)
    )
    dataset_candidates = sorted(
        f
        for f in files
        if re.fullmatch(r"config/multidatabackend[^/]*\.json\.example", f)
        or (f.startswith("simpletuner/examples/") and f.endswith(".json") and not f.endswith("/config.json"))
    )
    top = options_keys(git(repo, "show", f"{commit}:{OPTIONS_MD}"))
    for path in top_files:
        top |= config_keys(lenient_json(git(repo, "show", f"{commit}:{path}")))
    dataset, nested = dataloader_doc_keys(git(repo, "show", f"{commit}:{DATALOADER_MD}"))
    dataset_files = []
    for path in dataset_candidates:
        data = lenient_json(git(repo, "show", f"{commit}:{path}"))
        entries = entries_of(data) if isinstance(data, list) else []
        if not entries:
            continue  # prompt libraries, LyCORIS configs, templates: not dataloader configs
        dataset_files.append(path)
        for entry in entries:
            dataset |= set(entry)
            nested |= nested_keys(entry)
    return {
        "source": {
            "repo": REPO_NAME,
            "commit": commit,
            "files": sorted([OPTIONS_MD, DATALOADER_MD, *top_files, *dataset_files]),
        },
        "top": sorted(top),
        "dataset": sorted(dataset),
        "dataset_nested": sorted(nested),
    }


def render(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True, help="a SimpleTuner git checkout or bare clone")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="the commit to read (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write (default: %(default)s)")
    args = parser.parse_args(argv)
    data = snapshot(args.repo, args.commit)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(data), encoding="utf-8")
    print(f"{args.output}: {len(data['top'])} top-level keys, {len(data['dataset'])} dataset keys", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
