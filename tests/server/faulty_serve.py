"""`specserve serve` with faults a test switches on through files in a control folder.

`python -m tests.server.faulty_serve CONTROL_DIR serve ...` runs the real server (the real
engine, tokenizer and app) after wrapping two methods, so a test can make them misbehave on
cue by creating a file in CONTROL_DIR:

- `die`: the next engine step raises SystemExit (the engine thread dies; the file goes);
- `fail`: the next engine step raises RuntimeError("secret-detail") (the file goes);
- `hold`: engine steps wait while the file exists (a step that does not return);
- `slow`: each engine step first sleeps 0.5 s while the file exists;
- `paced`: each engine step first sleeps 0.02 s while the file exists (a long request keeps
  running for a while, its output still coming quickly);
- `hold-prep`: preparing a prompt whose text holds "HOLD-PREP" waits while the file exists
  (and says so by creating `prep-held`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from specserve import cli
from specserve.engine.engine import LLMEngine
from specserve.models.tokenizer import Tokenizer

MARK = "HOLD-PREP"


def install(control: Path) -> None:
    step, encode, encode_chat = LLMEngine.step, Tokenizer.encode, Tokenizer.encode_chat

    def faulty_step(self):
        for name, error in (("die", SystemExit(3)), ("fail", RuntimeError("secret-detail"))):
            if (control / name).exists():
                (control / name).unlink()
                raise error
        while (control / "hold").exists():
            time.sleep(0.02)
        if (control / "slow").exists():
            time.sleep(0.5)
        if (control / "paced").exists():
            time.sleep(0.02)
        return step(self)

    def held(text: str) -> None:
        if MARK in text and (control / "hold-prep").exists():
            (control / "prep-held").touch()
        while MARK in text and (control / "hold-prep").exists():
            time.sleep(0.02)

    def faulty_encode(self, text, *args, **kwargs):
        held(text)
        return encode(self, text, *args, **kwargs)

    def faulty_encode_chat(self, messages, *args, **kwargs):
        held("".join(str(m.get("content")) for m in messages))
        return encode_chat(self, messages, *args, **kwargs)

    LLMEngine.step = faulty_step
    Tokenizer.encode = faulty_encode
    Tokenizer.encode_chat = faulty_encode_chat


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    sys.exit(cli.main(sys.argv[2:]))
