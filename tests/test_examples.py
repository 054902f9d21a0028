"""The examples run end to end on small data, as a user would start them, and leave what they promise."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from helpers.sources import sample_equal
from helpers.torchrun import two_nodes
from mmapcache import MmapCachedDataset
from mmapcache.store import files as _files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT = 150.0


def run(command: list[str], env: dict[str, str] | None = None) -> str:
    """Runs a command in its own session (killed with all its children on timeout); returns its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **(env or {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=TIMEOUT)
        raise AssertionError(f"{command} did not finish in {TIMEOUT} s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, f"{command} exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_folder_cold_then_warm(shm_dir: str, tmp_path) -> None:
    cache = os.path.join(shm_dir, "jpegs")
    data = tmp_path / "data"
    args = [sys.executable, os.path.join(EXAMPLES, "image_folder.py"), "--data-dir", str(data), "--images", "24",
            "--size", "32", "--epochs", "2", "--workers", "2", "--batch-size", "8", "--cache", cache]
    out = run(args)
    created = re.search(r"\(new: (\d+) samples stored while creating it, (\d+) to fill\)", out)
    assert created and int(created.group(1)) + int(created.group(2)) == 24, out
    assert re.search(r"epoch 1: .*\(cold: decoding JPEGs\)", out) and re.search(r"epoch 2: .*\(warm\)", out), out
    assert "summary: 24 of 24 images cached" in out and "faster from the cache" in out, out
    folder = data / "jpegs-24"
    assert os.listdir(data) == ["jpegs-24"]  # generated once, where asked, nothing else
    assert sum(len(files) for _, _, files in os.walk(folder)) == 24

    example = load_example("image_folder")
    source = example.JpegFolder(str(folder), 32)
    with MmapCachedDataset(cache) as ds:  # the cache holds exactly what the slow dataset computes
        assert ds.num_cached == 24 and all(sample_equal(ds[i], source[i]) for i in range(24))

    out = run(args)  # a second run starts warm and reuses the same images and cache
    assert "(24 of 24 samples already cached)" in out and re.search(r"epoch 1: .*\(warm\)", out), out
    assert "generating" not in out and os.listdir(shm_dir) == ["jpegs"]


def test_image_folder_source_errors_and_fingerprint(tmp_path) -> None:
    example = load_example("image_folder")
    with pytest.raises(FileNotFoundError, match=r"no \.jpg/\.jpeg files under"):
        example.JpegFolder(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        example.JpegFolder(str(tmp_path / "missing"))
    example.generate_images(str(tmp_path / "a"), 3)
    first = example.JpegFolder(str(tmp_path / "a"), 16).fingerprint()
    assert example.JpegFolder(str(tmp_path / "a"), 16).fingerprint() == first
    assert example.JpegFolder(str(tmp_path / "a"), 24).fingerprint() != first  # preprocessing config counts
    os.utime(example.JpegFolder(str(tmp_path / "a")).files[0], ns=(0, 0))
    assert example.JpegFolder(str(tmp_path / "a"), 16).fingerprint() != first  # a changed file counts


def test_two_scripts_fill_then_unrelated_reader(shm_dir: str) -> None:
    cache = os.path.join(shm_dir, "features")
    out = run([sys.executable, os.path.join(EXAMPLES, "two_scripts.py"), "--samples", "40", "--cache", cache])
    fill = re.search(r"fill: stored (\d+) samples .* digest (\w+)", out)
    read = re.search(r"read: 40 samples .* without the source; digest (\w+)", out)
    assert fill and read, out
    assert int(fill.group(1)) == 40  # all of them: sample 0 and probes while creating the cache, the rest by fill()
    assert fill.group(2) == read.group(1)
    assert _files.is_cache(cache)  # persists after both processes exited


def test_fresh_augmentation_stream(shm_dir: str, tmp_path) -> None:
    out = run([sys.executable, os.path.join(EXAMPLES, "fresh_augmentation.py"), "--data-dir", str(tmp_path),
               "--images", "64", "--size", "32", "--epochs", "2", "--batch-size", "8", "--step-ms", "20",
               "--producers", "1"])
    assert "a ring of 16 samples (25% of the dataset); 1 producer(s) started here" in out, out
    for epoch in (0, 1):
        found = re.search(rf"epoch {epoch}: [\d.]+ s, (\d+) of 64 served fresh from the ring .*, (\d+) computed by "
                          r"the trainer", out)
        assert found and int(found.group(1)) + int(found.group(2)) == 64, out
    assert "repeated computations served: 0" in out, out
    assert os.listdir(shm_dir) == []  # delete_on_close: the stream is gone


def test_ddp_example_under_torchrun(shm_dir: str) -> None:
    cache = os.path.join(shm_dir, "ddp")
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(EXAMPLES, "ddp.py"), "--samples", "64", "--epochs", "2", "--steps", "2",
               "--batch-size", "8", "--workers", "1", "--cache", cache, "--delete-on-close"])
    stored = [int(n) for n in re.findall(r"rank \d/2: prefill stored (\d+) samples .* 64/64 cached", out)]
    created = [int(n) for n in re.findall(r"rank \d/2: created .* with (\d+) samples", out)]
    assert len(stored) == 2 and len(created) == 1, out
    assert sum(stored) + created[0] == 64, out  # disjoint shares, each sample computed once on the node
    assert re.search(r"epoch 1: mean loss over 2 ranks \d+\.\d+", out), out
    assert os.listdir(shm_dir) == []  # --delete-on-close: the last rank out removed the cache


def test_lightning_example_checkpoints_and_resumes_mid_epoch(shm_dir: str, tmp_path) -> None:
    script = os.path.join(EXAMPLES, "lightning_ddp.py")
    ckpt = str(tmp_path / "ckpt")
    common = [sys.executable, script, "--data-dir", str(tmp_path / "data"), "--images", "64", "--epochs", "2",
              "--cache", os.path.join(shm_dir, "lightning"), "--checkpoints", ckpt, "--every", "3"]
    out = run(common)  # 2 ranks x 2 batches of 16 per epoch: a checkpoint at step 3, mid epoch 1
    assert re.search(r"rank 1: epoch 1 batch 1 \(step 3\)", out) and "done: 4 steps" in out, out
    out = run([*common, "--resume", os.path.join(ckpt, "epoch=1-step=3.ckpt")])
    assert "rank 0: resumed at epoch 1 batch 1" in out and "rank 1: resumed at epoch 1 batch 1" in out, out
    assert "epoch 0" not in out and "done: 4 steps" in out, out


def test_ddp_example_with_node_shares_on_two_nodes(shm_dir: str) -> None:
    out = two_nodes(lambda node: [os.path.join(EXAMPLES, "ddp.py"), "--samples", "64", "--epochs", "3", "--steps",
                                  "2", "--batch-size", "8", "--workers", "0", "--cache", "ddp", "--node-share",
                                  "--rotate-every", "2"], shm_dir)
    for node in (0, 1):
        shown = re.findall(rf"prefill stored \d+ samples .* 32/64 cached .*\(share: node {node} of 2: 32 of 64 "
                           r"indices \(seed 0, drawn again every 2 epochs\)\)", out)
        assert len(shown) == 2, out  # both ranks of the node
    assert re.search(r"epoch 2: mean loss over 4 ranks \d+\.\d+", out), out


def test_prewarm_script(shm_dir: str, tmp_path) -> None:
    search = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("mmapcache", path=search) is None:
        pytest.skip("the `mmapcache` command is not installed (pip install -e .)")
    cache = os.path.join(shm_dir, "prewarmed")
    out = run(["bash", os.path.join(EXAMPLES, "prewarm.sh"), "1"],
              env={"CACHE": cache, "IMAGES": "24", "SIZE": "32", "DATA_DIR": str(tmp_path), "WORKERS": "1",
                   "BUILD_WORKERS": "1", "WATCH_INTERVAL": "0.5", "PYTHON": sys.executable})
    assert "summary: 24 of 24 images cached" in out, out
    assert "[prewarm] build finished:" in out and re.search(r"filled:\s+24 of 24 rows \(100.0%\)", out), out
    assert os.listdir(shm_dir) == ["prewarmed"]


def test_mixture_reads_its_weights_follows_its_curriculum_and_resumes_on_two_ranks(shm_dir: str) -> None:
    out = run([sys.executable, os.path.join(EXAMPLES, "mixture.py"), "--cache-dir", shm_dir, "--epochs", "3",
               "--epoch-size", "300", "--batch-size", "16"])
    assert "per epoch: {'web': 210, 'code': 60, 'curated': 30} of 300 samples" in out, out
    assert re.search(r"epoch 1: \{'web': 210, 'code': 60, 'curated': 30\}", out), out
    assert re.search(r"epoch 2: \{'web': 150, 'code': 60, 'curated': 90\}", out), out  # the curriculum's step
    resumed = re.search(r"(\d+) samples left, (\d+) read by the 2 ranks \((\d+) of padding\), the same sources: True",
                        out)
    assert resumed and int(resumed.group(1)) + int(resumed.group(3)) == int(resumed.group(2)), out


def test_text_tokenizes_once_then_trains_from_the_cache_padded_and_flat(shm_dir: str) -> None:
    """A real tokenizer's ids, stored narrower (int32, the mask as ones), read back as the tokenizer gives them; the
    second run (padding-free batches) starts warm; the model's loss is finite and falls over the epochs."""
    pytest.importorskip("transformers")
    cache = os.path.join(shm_dir, "text")
    args = [sys.executable, os.path.join(EXAMPLES, "text.py"), "--documents", "120", "--epochs", "3",
            "--batch-size", "8", "--max-length", "64", "--cache", cache]
    out = run(args)
    assert re.search(r"epoch 1: .*\(cold: tokenizing\)", out) and re.search(r"epoch 3: .*\(warm\)", out), out
    assert "summary: 120 of 120 documents cached" in out, out
    losses = [float(x) for x in re.findall(r"mean loss (\S+)", out)]
    assert len(losses) == 3 and all(x == x for x in losses) and losses[-1] < losses[0], out
    flat = run([*args, "--flatten", "--epochs", "1"])
    assert "(120 of 120 documents cached)" in flat and re.search(r"epoch 1: .*\(warm\)", flat), flat

    example = load_example("text")
    documents = example.stdlib_documents(120)
    source = example.Tokenized(documents, example.train_tokenizer(documents, 2000), 64)
    # By path, without the source: what the example stored, under the same documents, vocabulary and truncation
    # (another fingerprint would be refused).
    with MmapCachedDataset(cache, fingerprint=source.fingerprint()) as ds:
        for i in range(len(documents)):
            assert sample_equal(ds[i], source[i]), i
