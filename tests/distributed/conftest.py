from tests.integration.conftest import train_data  # noqa: F401  (the shared prepared corpus)
