"""The one fixture every GPU test needs: CuPy with a device, or a clean skip."""
import pytest


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except Exception as err:  # no driver
        pytest.skip(f"no usable CUDA device: {err}")
    return cupy


@pytest.fixture(scope="module")
def libs(cp):
    """(CUDA, numpy) op libraries over the same generated ops."""
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.ops import OpLibrary
    return OpLibrary(get_backend("cuda")), OpLibrary(get_backend("numpy"))
