"""README's curl command (section "The OpenAI API (HTTP)"), run against a scheduler's HTTP port: the
tests of each way to start the services (`make serve`, compose) check that it is answered."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SH_BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)
README_ADDRESS = "127.0.0.1:8000"  # the default --http-port, which the command names


def readme_curl() -> list[str]:
    """The section's first `curl` command, as a shell splits it."""
    section = README.read_text().split("## The OpenAI API (HTTP)", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in SH_BLOCK.findall(section) if b.startswith("curl ")]
    assert blocks, "README's OpenAI section has no curl block"
    return shlex.split(blocks[0].replace("\\\n", " "))


def run_readme_curl(http_port: int) -> tuple[dict, dict]:
    """(the request body, the JSON answer) of README's curl command sent to `http_port`: by curl
    where it is installed, else the same request by urllib."""
    cmd = readme_curl()
    url = cmd[next(i for i, a in enumerate(cmd) if a.startswith("http://"))]
    assert README_ADDRESS in url, url
    cmd = [a.replace(README_ADDRESS, f"127.0.0.1:{http_port}") for a in cmd]
    body = cmd[cmd.index("-d") + 1]
    if shutil.which("curl"):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(body), json.loads(done.stdout)
    headers = dict(h.split(": ", 1) for i, h in enumerate(cmd) if cmd[i - 1] == "-H")
    request = urllib.request.Request(url.replace(README_ADDRESS, f"127.0.0.1:{http_port}"),
                                     data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(body), json.loads(reply.read())
    except urllib.error.HTTPError as e:  # curl -s prints an error's body too
        return json.loads(body), json.loads(e.read())


def assert_readme_curl_answered(http_port: int) -> None:
    """README's curl gets a chat completion from the model it names, as README shows it."""
    body, answer = run_readme_curl(http_port)
    assert answer.get("model") == body["model"], answer
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
