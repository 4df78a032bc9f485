"""Exceptions of the kvd package: one class per kvd status code, all subclasses of kvd.Error."""

_CODE_NAMES = {
    1: "INVALID_ARGUMENT", 2: "NOT_FOUND", 3: "ALREADY_EXISTS", 4: "OUT_OF_RANGE",
    5: "FAILED_PRECONDITION", 6: "RESOURCE_EXHAUSTED", 7: "DEADLINE_EXCEEDED",
    8: "UNAVAILABLE", 9: "DATA_LOSS", 10: "UNIMPLEMENTED", 11: "INTERNAL", 12: "CANCELLED",
    13: "ABORTED", 14: "PERMISSION_DENIED",
}


class Error(Exception):
    """A failed kvd call. ``code`` is the numeric status code (kvd::StatusCode, the same values
    as the C ABI's KVD_* codes and kvdctl's JSON), ``code_name`` its name ("NOT_FOUND") and
    ``message`` the daemon's or client's explanation."""

    def __init__(self, code, code_name, message):
        super().__init__(f"{code_name}: {message}")
        self.code = code
        self.code_name = code_name
        self.message = message


def _class_name(code_name):
    return "".join(part.capitalize() for part in code_name.split("_")) + "Error"


_BY_CODE = {}
for _code, _name in _CODE_NAMES.items():
    _BY_CODE[_code] = type(_class_name(_name), (Error,), {"__doc__": f"kvd status {_name}."})
    globals()[_class_name(_name)] = _BY_CODE[_code]


def error_for_code(code):
    """The exception class for a status code (kvd.Error for an unknown one)."""
    return _BY_CODE.get(code, Error)


__all__ = ["Error", "error_for_code"] + [_class_name(n) for n in _CODE_NAMES.values()]
