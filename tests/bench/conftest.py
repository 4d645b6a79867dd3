"""The tiny served model of the server's tests, for the load and soak clients' tests."""

from tests.server.conftest import model_dir  # noqa: F401 (a fixture)
