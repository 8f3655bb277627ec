"""Multi-process training: examples/train_accelerate.py under `accelerate launch` (DDP; FSDP on 2 GPUs) and FoX under
FSDP2 sharding (tests/fsdp2_worker.py under torchrun), each checked by reloading the saved model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_accelerate.py"
CONFIGS = ROOT / "examples" / "accelerate"


def run(command, tmp_path, cpu):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # processes over gloo, also on a machine with GPUs
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def launch_example(config, tmp_path, cpu, *extra):
    output_dir = tmp_path / "run"
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
         "--num_processes", "2", *extra, str(EXAMPLE), "--size", "tiny", "--context", "128", "--batch-size", "2",
         "--steps", "6", "--max-shard-size", "100KB", "--output-dir", str(output_dir)], tmp_path, cpu)
    return output_dir, json.loads((output_dir / "train_metrics.json").read_text())


def check_trained_and_reloaded(output_dir, metrics, tolerance):
    assert metrics["world_size"] == 2 and metrics["tokens_per_step"] == 2 * 2 * 128
    assert all(torch.isfinite(torch.tensor(metrics["losses"]))) and len(metrics["losses"]) == 6
    assert metrics["last_loss"] < metrics["first_loss"]
    assert metrics["tokens_per_s"] > 0
    # Saved in several safetensors shards with their index, and reloaded into the same function.
    assert (output_dir / "model" / "model.safetensors.index.json").exists()
    assert len(list((output_dir / "model").glob("model-*-of-*.safetensors"))) > 1
    assert metrics["reload"]["model_class"] == "FoxForCausalLM"
    assert metrics["reload"]["max_rel_diff"] <= tolerance


def test_ddp_training_with_accelerate_launch_saves_sharded_and_reloads_equal_logits(tmp_path):
    # fp32 on the CPU: `--mixed_precision no` overrides the config's bf16 (bf16 autocast on a CPU is slow).
    output_dir, metrics = launch_example("ddp.yaml", tmp_path, True, "--mixed_precision", "no")
    assert metrics["distributed_type"] == "DistributedType.MULTI_CPU"
    check_trained_and_reloaded(output_dir, metrics, tolerance=1e-5)


def test_pretraining_keeps_an_earlier_run_unless_forced_and_never_replaces_a_folder_it_did_not_write(tmp_path):
    from foxlm.outputs import OutputError
    from foxlm.pretrain import main

    options = ["--size", "tiny", "--context", "64", "--batch-size", "1", "--steps", "2", "--output-dir",
               str(tmp_path / "run")]
    main(options)
    first = (tmp_path / "run" / "train_metrics.json").read_text()
    with pytest.raises(OutputError, match="pass --force"):
        main(options)
    assert (tmp_path / "run" / "train_metrics.json").read_text() == first
    main([*options, "--force"])
    assert (tmp_path / "run" / "model" / "config.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if ".foxlm-" in p.name]  # no staging left beside it
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OutputError, match="not written by foxlm"):
        main([*options[:-1], str(tmp_path / "mine"), "--force"])
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    "needs 2 GPUs: accelerate turns FSDP on only for accelerator process groups (AcceleratorState switches to "
    "DistributedType.FSDP from MULTI_GPU/XPU/NPU/..., never from MULTI_CPU), so on a CPU `accelerate launch` with "
    "fsdp.yaml silently trains as plain data parallelism. FSDP2 itself runs on a CPU: see the torchrun test below."))
def test_fsdp_training_with_accelerate_launch_saves_sharded_and_reloads_equal_logits(tmp_path):
    output_dir, metrics = launch_example("fsdp.yaml", tmp_path, False)
    assert metrics["distributed_type"] == "DistributedType.FSDP" and metrics["fsdp_version"] == 2
    check_trained_and_reloaded(output_dir, metrics, tolerance=2e-2)  # bf16 compute in both


def test_fsdp2_shards_every_decoder_layer_trains_like_one_process_and_round_trips(tmp_path):
    result_path = tmp_path / "result.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "tests" / "fsdp2_worker.py"), str(result_path), str(tmp_path / "model")], tmp_path, cpu=True)
    result = json.loads(result_path.read_text())
    # `_no_split_modules` names the decoder layer class, so every layer becomes its own FSDP unit.
    assert result["wrap_classes"] == ["FoxDecoderLayer"] and result["wrapped_modules"] == 2
    assert result["layers_sharded"]
    assert result["single_process_max_abs_diff"] < 1e-4
    assert result["reload_max_abs_diff"] < 1e-5
    assert (tmp_path / "model" / "model.safetensors.index.json").exists()


def test_fsdp_scaling_script_runs_one_and_two_processes_and_writes_their_ratio(tmp_path):
    # On a CPU the processes train as plain data parallelism (see above): this checks the driver and its result file.
    env = dict(SIZE="tiny", CONTEXT="64", BATCH="2", STEPS="7", OUT=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_fsdp_scaling.sh")], env=dict(
        os.environ, **env, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (path,) = tmp_path.glob("fsdp_scaling_tiny_b2_cpu_*.json")
    result = json.loads(path.read_text())
    runs = result["runs"]
    assert [runs[name]["world_size"] for name in ("plain", "fsdp1", "fsdp2")] == [1, 1, 2]
    assert runs["plain"]["distributed_type"] == "DistributedType.NO"
    assert all(run["timed_steps"] == 2 and run["reload"]["max_rel_diff"] <= 2e-2 for run in runs.values())
    assert result["scaling"] == runs["fsdp2"]["tokens_per_s"] / runs["fsdp1"]["tokens_per_s"]
    assert result["scaling_over_no_fsdp"] == runs["fsdp2"]["tokens_per_s"] / runs["plain"]["tokens_per_s"]
    assert result["met"] == (result["scaling"] >= 1.8)
