"""The control channel's endpoint file (issue 54): published atomically
through a temporary name no one can predict, never through a planted link."""

import json
import os
import stat
from types import SimpleNamespace

from sessionkv.engine.control import ControlChannel


def test_the_endpoint_file_follows_no_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "engine.json"
    for pid in range(os.getpid() - 50, os.getpid() + 50):  # the old, predictable names
        (tmp_path / f"engine.json.tmp-{pid}").symlink_to(victim)
    channel = SimpleNamespace(endpoint="tcp://127.0.0.1:5555", info={"rank": 0})
    ControlChannel.write_endpoint_file(channel, str(path))
    assert victim.read_text() == "precious"
    assert json.loads(path.read_text()) == {"control": "tcp://127.0.0.1:5555", "rank": 0}
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o644
    leftovers = {p.name for p in tmp_path.iterdir()} - {"victim", "engine.json"}
    assert all(n.startswith("engine.json.tmp-") for n in leftovers)  # only the planted links
    path.unlink()
    path.symlink_to(victim)  # a link at the file's own name is replaced
    ControlChannel.write_endpoint_file(channel, str(path))
    assert victim.read_text() == "precious" and not path.is_symlink()
