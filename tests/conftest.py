
import pytest



@pytest.fixture
def cli(capsys):
    """Run `normexport ARGS...` in-process: returns (exit code, stdout, stderr)."""
    from normexport.cli import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
