from .elastic import ElasticBuffer, EPHandle  # noqa: F401
from .legacy import Buffer  # noqa: F401
