"""OpenVINO's export child sends no telemetry (issue 19: openvino.convert_model made HTTPS requests to Google
Analytics and wrote ~/intel during every export)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from netquant.export import openvino as ovx
from tests.helpers.found_models import gray_conv

pytest.importorskip("openvino")

# prepended to the child: every name lookup or socket connection is logged (and refused); the home folder is a
# fresh one, so a consent / client-id file written by telemetry would show
NETWORK_SENTINEL = r'''
import os, socket
_log = os.environ["NETQUANT_TEST_NET_LOG"]
def _record(what):
    def refuse(*args, **kwargs):
        with open(_log, "a") as f:
            f.write(what + " " + repr(args[:2]) + "\n")
        raise OSError("network refused by the test")
    return refuse
socket.getaddrinfo = _record("getaddrinfo")
socket.socket.connect = _record("connect")
socket.socket.connect_ex = _record("connect")
'''


def test_the_openvino_child_makes_no_network_request_and_writes_nothing_home(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    log, home = tmp_path / "net.log", tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("NETQUANT_TEST_NET_LOG", str(log))
    monkeypatch.setenv("HOME", str(home))
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((1, 1, 16, 16)).astype(np.float32)
    run = ovx.run_in_openvino(tmp_path / "m.onnx", [{"x": x}], "telemetry test", xml_path=tmp_path / "m.xml",
                              child_source=NETWORK_SENTINEL + ovx._CHILD)
    assert not log.exists(), log.read_text()
    assert list(home.iterdir()) == []
    import onnxruntime as ort

    ref = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(run.outputs[0]["y"], ref, rtol=1e-4, atol=1e-5)  # the child did its work
