"""Optional dependencies: without psycopg, hypercorn or httpx installed, interlock works and says
what to install when a ``postgresql://`` store, the gateway or its client is asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

MISSING_PSYCOPG = (
    "a postgresql:// store needs psycopg, which is not installed; "
    "install it with pip install 'interlock[postgres]'"
)

# Runs its argument with psycopg and hypercorn made unimportable, as in an install without extras.
WITHOUT_EXTRAS = (
    "import sys; sys.modules['psycopg'] = None; sys.modules['hypercorn'] = None; "
    "sys.modules['httpx'] = None; "
    "sys.argv = ['interlock', *sys.argv[1:]]; "
)


def python(code, *args, cwd=None):
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS + code, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, COLUMNS="200"),
        timeout=120,
        check=False,
    )


def test_open_store_without_psycopg_says_which_extra_to_install():
    code = (
        "import trio\n"
        "from interlock import StoreError\n"
        "from interlock.stores import open_store\n"
        "try:\n"
        "    trio.run(open_store, 'postgresql://nobody@127.0.0.1:1/none')\n"
        "except StoreError as exc:\n"
        "    print(exc)\n"
    )
    done = python(code)
    assert done.stderr == ""
    assert done.stdout == MISSING_PSYCOPG + "\n"


def test_cli_without_psycopg_prints_one_line_and_fails():
    cli = "import runpy; runpy.run_module('interlock', run_name='__main__')"
    done = python(cli, "runs", "--db", "postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == f"interlock: error: {MISSING_PSYCOPG}\n"


def test_demo_runs_without_psycopg_or_hypercorn(tmp_path):
    cli = "import runpy; runpy.run_module('interlock', run_name='__main__')"
    done = python(
        cli, "demo", "--runs", "12", "--latency", "0,0", "--json", "--db", "j.db", cwd=tmp_path
    )
    assert done.stderr == ""
    assert done.returncode == 0
    # every run ended (the chaos model's dice depend on the run ids, which carry the time)
    outcomes = json.loads(done.stdout)["outcomes"]
    assert sum(outcomes.values()) == 12
    assert set(outcomes) <= {"completed", "escalated", "failed"}


def test_serve_without_hypercorn_prints_one_line_and_fails(tmp_path):
    cli = "import runpy; runpy.run_module('interlock', run_name='__main__')"
    done = python(cli, "serve", "--port", "0", "--db", "j.db", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "interlock: error: the gateway needs hypercorn, which is not installed; install the "
        "gateway extra: pip install 'interlock[gateway]'\n"
    )


def test_the_client_without_httpx_says_which_extra_to_install():
    done = python(
        "\ntry:\n    import interlock.client\nexcept ImportError as exc:\n    print(exc)\n"
    )
    assert done.stdout == (
        "interlock.client needs httpx, which is not installed; install the client extra: "
        "pip install 'interlock[client]'\n"
    )
