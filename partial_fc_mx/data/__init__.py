"""Reading face datasets for training and evaluation: RecordIO records and their index
(recordio.py, record_index.py), decoding, alignment and augmentation (transforms.py,
align.py, augment.py), the backbone's input (network_input.py), the loader that feeds
each rank its share of a global batch (loader.py, device.py) and insightface's .bin
verification sets (verification_set.py). Preparing datasets lives in prep/. FACE_SIZE
(transforms.py) is the data's: the 112 x 112 aligned crops of insightface's datasets,
which every backbone takes."""

from ..errors import UserError


class DataError(UserError, ValueError):
    """A dataset or file that cannot be used as it is; the message names the file and
    record."""
