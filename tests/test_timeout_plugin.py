"""pytest-timeout is loaded: a test over its @pytest.mark.timeout really is stopped."""

import subprocess
import sys
import textwrap


def test_timeout_marker_stops_a_test(tmp_path):
    (tmp_path / "test_sleeper.py").write_text(textwrap.dedent("""
        import time
        import pytest

        @pytest.mark.timeout(1)
        def test_sleeps():
            time.sleep(30)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
                           str(tmp_path / "test_sleeper.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Timeout" in proc.stdout, proc.stdout[-2000:]


def test_the_projects_pytest_config_loads_pytest_timeout(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) == 1800
    assert "pytest-timeout>=2.1" in pytestconfig.getini("required_plugins")
