"""CI runs exactly the README's test command (.ci/run's last line), so the README's figure for
how long the suite takes is CI's."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command():
    readme = [line.strip() for line in (REPO / "README.md").read_text().splitlines()]
    [command] = [line for line in readme if line.startswith("bash scripts/setup.sh") and " pytest " in line]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == command
