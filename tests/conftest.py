"""Test suite root. tests/ is a package, so test modules may share helpers
(`from tests.helpers import ...`) and equal basenames in different folders don't clash."""

# The local S3-compatible server's fixtures (moto_endpoint, s3_bucket, flaky_s3), for any test that names them.
pytest_plugins = ["tests.storage_server"]
