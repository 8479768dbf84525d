"""The listener flags both services share: which hosts count as loopback (no token needed
there), and a token read from its flag or its file."""
import argparse

import pytest

from pagedserve_common.listener_flags import is_loopback, read_token


@pytest.mark.parametrize("host,loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.0.0.1", False),
    ("example.com", False), ("", False)])
def test_only_loopback_hosts_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_token_comes_from_its_flag_or_its_file_stripped(tmp_path):
    parser = argparse.ArgumentParser()
    path = tmp_path / "token"
    path.write_text(" s3cret\n")
    assert read_token(parser, None, str(path), "--api-key") == "s3cret"
    assert read_token(parser, "given", None, "--api-key") == "given"
    assert read_token(parser, None, None, "--api-key") is None


@pytest.mark.parametrize("case,message", [
    ("both", "give --api-key or --api-key-file, not both"), ("missing", "--api-key-file: "),
    ("empty", "--api-key-file {path} is empty")])
def test_a_bad_token_file_is_a_usage_error_naming_the_flag(tmp_path, capsys, case, message):
    path = tmp_path / "token"
    if case != "missing":
        path.write_text("  \n" if case == "empty" else "s3cret")
    with pytest.raises(SystemExit) as exit_info:
        read_token(argparse.ArgumentParser(), "given" if case == "both" else None, str(path),
                   "--api-key")
    assert exit_info.value.code == 2
    assert message.format(path=path) in capsys.readouterr().err
