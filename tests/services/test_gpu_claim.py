"""services.gpu_claim: each worker container takes a GPU no other holds, keeps it for exactly
as long as its worker process lives (the lock survives the exec), and waits when every GPU is
held. No GPU is needed: the GPUs are named through CUDA_VISIBLE_DEVICES, which the claim
narrows to the one it took."""

import os
import subprocess
import sys
import time
from pathlib import Path

from services.gpu_claim import lock_path, try_claim

ROOT = Path(__file__).resolve().parents[2]
SHOW_GPU = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True)"


def claim_argv(lock_dir: Path, *command: str) -> list[str]:
    return [sys.executable, "-m", "services.gpu_claim", "--dir", str(lock_dir), "--poll", "0.1",
            "--", *command]


def env_with(gpus: str) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONPATH": str(ROOT)}


def test_claims_are_exclusive_until_released(tmp_path: Path) -> None:
    first = try_claim(tmp_path, ["0", "1"])
    second = try_claim(tmp_path, ["0", "1"])
    assert first is not None and second is not None
    assert (first[0], second[0]) == ("0", "1")
    assert try_claim(tmp_path, ["0", "1"]) is None
    os.close(first[1])                                # its worker exited
    again = try_claim(tmp_path, ["0", "1"])
    assert again is not None and again[0] == "0"
    assert lock_path(tmp_path, "GPU-a/b:1").name == "gpu-GPU-a_b_1.lock"
    for _, fd in (second, again):
        os.close(fd)


def test_the_worker_gets_one_free_gpu_and_holds_it_while_it_runs(tmp_path: Path) -> None:
    held = try_claim(tmp_path, ["0"])                 # another worker has GPU 0
    assert held is not None
    out = subprocess.run(claim_argv(tmp_path, sys.executable, "-c", SHOW_GPU),
                         env=env_with("0,1"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    os.close(held[1])

    # The lock passes to the exec'd command: held while it runs, free once it is gone.
    worker = subprocess.Popen(
        claim_argv(tmp_path, sys.executable, "-c", SHOW_GPU + "; import time; time.sleep(60)"),
        env=env_with("0"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "0"
        assert try_claim(tmp_path, ["0"]) is None
    finally:
        worker.kill()
        worker.wait()
    freed = try_claim(tmp_path, ["0"])
    assert freed is not None
    os.close(freed[1])


def test_waits_while_every_gpu_is_held(tmp_path: Path) -> None:
    held = try_claim(tmp_path, ["0"])
    assert held is not None
    waiting = subprocess.Popen(claim_argv(tmp_path, sys.executable, "-c", SHOW_GPU),
                               env=env_with("0"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stderr is not None
        assert "held by other workers; waiting" in waiting.stderr.readline()
        time.sleep(0.3)
        assert waiting.poll() is None                 # still waiting, not crashing
        os.close(held[1])
        out, _ = waiting.communicate(timeout=30)
        assert waiting.returncode == 0 and out.strip() == "0"
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()


def test_no_gpu_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(claim_argv(tmp_path, "true"), env=env_with(""), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "no CUDA GPU visible" in out.stderr
