"""Face datasets: RecordIO reading and packing, loaders, ORL faces, synthetic identities."""

from ..errors import UserError


class DataError(UserError, ValueError):
    """A dataset or file that cannot be used as it is; the message names the file and
    record."""
