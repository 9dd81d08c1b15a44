import pytest

from serve_helpers import start_server, stop_server


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield url
    stop_server(proc)
