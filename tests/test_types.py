"""The type checker's exceptions are a listed few: every ``# type: ignore`` in simpletuner/ is here, with why.

`.ci/run` runs mypy over simpletuner/ (pyproject.toml's ``[tool.mypy]``); an ignore that is no longer needed
fails there (``warn_unused_ignores``). A new one must be added below with the library fault it works around.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "simpletuner"

#: file -> the error codes ignored there, in order, each where a library's declared type is wrong.
LISTED = {
    # torch.compile's stub returns a plain callable; for a module it returns an OptimizedModule
    "training/knobs.py": ["return-value"],
    # diffusers wraps ModelMixin.to with functools.wraps(Module.to), which drops `self` from its type
    "models/wan22.py": ["arg-type", "call-arg"],
    # peft declares lora_alpha an int; it divides by r, and floats (SimpleTuner's alphas) work
    "models/adapters/peft_lora.py": ["arg-type"],
    # transformers wraps PreTrainedModel.to with functools.wraps(Module.to), which drops `self` from its type; peft's
    # lora_alpha as above
    "models/text_encoder_lora.py": ["call-arg", "arg-type"],
    # typeshed's sys.modules admits no None, which is how Python marks a module as not importable
    "models/library_probes.py": ["assignment"],
    # transformers' T5Config signature omits decoder_start_token_id, which it accepts and saves; Qwen2Tokenizer
    # declares merges as strings, though its BPE takes pairs only
    "testing/zoo.py": ["call-arg", "arg-type"],
}


def test_every_type_ignore_is_listed_with_its_reason():
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            for codes in re.findall(r"#\s*type:\s*ignore(?:\[([^\]]*)\])?", line):
                assert codes, f"{path}: a bare `type: ignore` hides every error on its line; name the code"
                found.setdefault(path.relative_to(PACKAGE).as_posix(), []).extend(c.strip() for c in codes.split(","))
    assert found == LISTED
