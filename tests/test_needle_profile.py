"""benchmarks/needle_profile.py: a whole run on a tiny FoX model on the CPU writes its three timings and the
profile's tables."""

import importlib.util
from pathlib import Path

from conftest import byte_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("needle_profile", ROOT / "benchmarks" / "needle_profile.py")
needle_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(needle_profile)


def test_a_run_writes_the_timings_and_the_profile(tmp_path, capsys):
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_model(vocab_size=258, bos_token_id=256, eos_token_id=257).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    needle_profile.main([str(model_dir), "--out", str(out), "--length", "24", "--batch", "2"])
    text = (out / "needle_profile.txt").read_text()
    timings = text.split("\n\n")[0].splitlines()
    assert [line.split(":")[0] for line in timings] == [
        "forward, no cache, logits_to_keep=1", "forward, cache, logits_to_keep=1",
        f"generate {needle_profile.NEW_TOKENS} tokens"]
    assert all(float(line.split(": ")[1].split(" s")[0]) > 0 for line in timings)
    assert text.count("Self CPU time total") == 2 and "aten::linear" in text
    assert timings[2] in capsys.readouterr().out
