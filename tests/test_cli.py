import pytest

from foxlm.cli import main


def test_demo_trains_saves_reloads_and_generates(tmp_path, capsys):
    main(["demo", "--output-dir", str(tmp_path / "demo"), "--steps", "3", "--batch-size", "2", "--context", "32",
          "--hidden-size", "32", "--layers", "1", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert "loss" in out and "greedy sample" in out
    assert (tmp_path / "demo" / "modeling_fox.py").exists() and (tmp_path / "demo" / "config.json").exists()


def test_demo_refuses_to_overwrite_without_force(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit, match="--force"):
        main(["demo", "--output-dir", str(tmp_path)])
    assert (tmp_path / "keep.txt").read_text() == "user data"
