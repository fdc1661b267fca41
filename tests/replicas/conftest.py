"""The replica tests reuse the pipeline package's toy pipeline and the reliability package's
server fixtures."""
from tests.pipeline.conftest import toy_pipeline  # noqa: F401 - a fixture
from tests.reliability.conftest import fault_model  # noqa: F401 - a fixture
