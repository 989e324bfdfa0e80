"""``mixerzoo generate``: streaming with the mixers' states, from checkpoints, folders; equal to recomputation."""

from __future__ import annotations

import io

import torch

from mixerzoo.cli import main
from mixerzoo.commands import generate as gen_cmd
from test_hub import recall, reference_model, text  # noqa: F401 - fixtures: the session's checkpoints (trained once)


class Recorder(io.StringIO):
    """A stdout that remembers each write (to see tokens arrive one by one)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def greedy_by_recomputation(model, prompt: list[int], n: int, eos_id: int | None = None) -> list[int]:
    """Reference: re-run the whole sequence for every new token (no states), take the argmax."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([seq]))[0][0, -1, : model.config.vocab_size].argmax())
            seq.append(nxt)
            if nxt == eos_id:
                break
    return seq[len(prompt):]


def test_greedy_stream_equals_recomputation_and_is_streamed(recall):
    out, err = Recorder(), io.StringIO()
    prompt = "5 40 9 33 12 50 5"
    assert gen_cmd.main([recall["last"], "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "10",
                         "--device", "cpu"], out=out, err=err) == 0
    words = out.getvalue().split()
    assert words[:7] == prompt.split()
    expected = greedy_by_recomputation(reference_model(recall["last"]), [int(w) for w in prompt.split()], 10)
    assert [int(w) for w in words[7:]] == expected
    assert len(out.writes) >= 1 + 10  # the prompt, then every token as it came
    report = err.getvalue()
    assert "7 prompt + 10 new tokens on cpu" in report and "tokens/s" in report and "state" in report


def test_text_checkpoint_and_export_generate_the_same(text, tmp_path, capsys):
    from mixerzoo.hub import export_checkpoint

    folder = export_checkpoint(text["last"], tmp_path / "shakespeare")
    args = ["--prompt", "KING:", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.95", "--seed", "3",
            "--max-new-tokens", "16"]
    runs = []
    for source in (text["last"], str(folder), str(folder)):
        assert main(["generate", source, *args]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] == runs[2] and runs[0].startswith("KING:")

    # top-k 1 is greedy; greedy matches recomputation with the checkpoint's tokenizer
    model, tok, eos = gen_cmd.load_for_generation(str(folder))
    ids = tok.encode("KING:").ids
    greedy, _ = gen_cmd.stream_text(model, tok, ids, io.StringIO(), 12, temperature=0, eos_id=eos)
    top1, _ = gen_cmd.stream_text(model, tok, ids, io.StringIO(), 12, temperature=1.0, top_k=1, eos_id=eos, seed=0)
    assert greedy == top1 == greedy_by_recomputation(reference_model(text["last"]), ids, 12, eos)


def test_generate_errors_are_one_line(recall, capsys):
    assert main(["generate", recall["last"], "--prompt", "1 2", "--max-new-tokens", "0"]) == 2
    assert "--max_new_tokens must be >= 1" in capsys.readouterr().err
    assert main(["generate", recall["last"]]) == 2  # no prompt and no end-of-text token to start from
    assert "--prompt is empty" in capsys.readouterr().err
    assert main(["generate", "no/such/place", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixerzoo: error:") and "Traceback" not in err
