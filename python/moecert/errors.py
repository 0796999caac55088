"""Exceptions raised by moecert: a ContractViolation carries the C++ record."""


class Error(RuntimeError):
    """A moecert call failed; `message` says why."""

    def __init__(self, message, op=""):
        super().__init__(message)
        self.message, self.op = message, op


class InvalidArgument(Error, ValueError):
    """An argument moecert rejects before any work (dtype, device, layout, shape, aliasing)."""


class ContractViolation(Error):
    """A contract clause failed under `enforce`. Attributes as the C++ moecert::Violation:
    op, clause, kind, group, level, location, observed, expected, message, file, line."""

    def __init__(self, record):
        for k, v in record.items():
            setattr(self, k, v)
        super().__init__(record["message"], record["op"])

    def __reduce__(self):
        fields = ("op", "clause", "kind", "group", "level", "location", "observed", "expected", "message", "file",
                  "line")
        return (ContractViolation, ({k: getattr(self, k) for k in fields},))


def raise_for(status, err):
    """Raises the exception for ABI status `status` (its name in the C header) with record `err`
    (moecert_error)."""
    text = {n: (getattr(err, n) or b"").decode("utf-8", "replace") for n in (
        "op", "clause", "kind", "group", "level", "location", "observed", "expected", "message", "file")}
    text["line"] = int(err.line)
    if status == "contract_violation":
        raise ContractViolation(text)
    if status == "invalid_argument":
        raise InvalidArgument(text["message"], text["op"])
    if status == "out_of_memory":
        raise MemoryError(text["message"])
    raise Error(text["message"], text["op"])
