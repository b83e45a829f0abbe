"""keras_vmoe.utils.import_hooks: code around each later import of a module."""

import sys

from keras_vmoe.utils import import_hooks


def test_a_hook_runs_around_each_import_of_its_module(tmp_path, monkeypatch):
    (tmp_path / "hooked_plain_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    seen = []

    def wrap(execute, module):
        seen.append(("before", hasattr(module, "VALUE")))
        execute(module)
        seen.append(("after", module.VALUE))

    import_hooks.around_import("hooked_plain_module", "test", wrap)
    import_hooks.around_import("hooked_plain_module", "test", wrap)  # once per key
    for _ in range(2):
        monkeypatch.delitem(sys.modules, "hooked_plain_module", raising=False)
        import hooked_plain_module

        assert hooked_plain_module.VALUE == 1
    assert seen == [("before", False), ("after", 1)] * 2
    assert "VALUE" in hooked_plain_module.__loader__.get_source("hooked_plain_module")
    import json  # other modules load as before

    assert json.loads("[1]") == [1]
