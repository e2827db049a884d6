"""tf_dp's native kernels: the float32 Box-Muller sampler fused into one TensorFlow op, and the
ghost convolution rule's patch extraction.

:func:`tf_dp.dp_query.noise.gaussian_noise` draws float32 noise (outside ``tf.distribute``)
with the op ``TfDpGaussianNoise`` when it is available (under XLA: the chunked kernel as an XLA
custom call, :func:`chunked_gaussian_noise_xla`), and with TensorFlow ops otherwise; :func:`tf_dp.dp_query.noise.add_gaussian_noise_structure` adds a large float32
leaf's noise with ``TfDpAddGaussianNoise`` (every chunk of the draw added to the leaf in one
op: no concatenation, no separate addition, the same values bit for bit), and a draw of several
chunks is one ``TfDpChunkedGaussianNoise``. Both read the same Philox words from the same
counters (the counter discipline of :mod:`tf_dp.dp_query.noise` is unchanged) and compute the
same formula; the native op does it in
one vectorised pass over memory, sharded over TensorFlow's intra-op threads, instead of about
fifteen TensorFlow kernels: about 4x less time for the reference MLP's 670k normals
(``bench/README.md``, "Noise floor"). Its logarithm, sine and cosine are its own (no libm; see
``gaussian_noise_op.cc``), so a value can differ from the TensorFlow ops' in the last bits; the
tail bound (:data:`tf_dp.dp_query.noise.TAIL_BOUND`) and the absence of exact zeros are the same,
and the tests check every angle cell and the extreme words. ``TfDpExtractPatches``
(``patches_op.cc``) is ``tf.image.extract_patches`` for ``[B, H, W, C]`` inputs as one copy pass,
the same values bit for bit; the ghost convolution rule unfolds its inputs with it outside XLA
(:func:`extract_patches_op`). ``TfDpConvKernelGrads`` (also ``patches_op.cc``) gives a 2-D
convolution kernel's per-example gradients without writing the patches to memory; the rule
uses it where it materialises per-example gradients (:func:`conv_kernel_grads_op`). Inside a
function compiled with XLA, where TensorFlow's kernels cannot run, the same computation is an XLA
CPU custom-call target that the library registers with XLA's registry when the installed
TensorFlow ships it (``libtensorflow_cc`` and its header): :func:`conv_kernel_grads_xla`,
:func:`chunked_gaussian_noise_xla`, :func:`xla_available`.

The ops are compiled from ``gaussian_noise_op.cc`` and ``patches_op.cc`` (shipped with the
package) into one library by the C++ compiler ``CXX`` (default ``g++``) the first time it is
needed, against the installed TensorFlow's headers,
for the CPU it runs on (``-march=native``), and cached in ``TF_DP_NATIVE_CACHE`` (default
``~/.cache/tf_dp/native``) under a name that hashes the source, the TensorFlow version, the
compiler, the flags and the CPU's feature flags. Without a compiler, with ``TF_DP_NATIVE=0``, or
where TensorFlow sees a GPU or TPU (the op is a CPU kernel; TensorFlow's own kernels draw the
noise on the device), the TensorFlow ops are used and :func:`status` says why.

Example::

    from tf_dp.dp_query import native
    native.available()   # True where a C++ compiler is installed
    native.status()      # e.g. 'loaded /root/.cache/tf_dp/native/gaussian_noise_3f2a....so'
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional

import tensorflow as tf

__all__ = [
    "available", "status", "set_enabled", "gaussian_noise_op", "add_gaussian_noise_op",
    "chunked_gaussian_noise_op", "box_muller_op", "extract_patches_op",
    "conv_kernel_grads_op", "xla_available", "conv_kernel_grads_xla",
    "chunked_gaussian_noise_xla",
]

#: compiled together into one library
_SOURCES = [pathlib.Path(__file__).with_name(name)
            for name in ("gaussian_noise_op.cc", "patches_op.cc")]
_FLAGS = [
    "-std=c++17", "-shared", "-fPIC", "-O3", "-march=native",
    # IEEE float32 as written: no fused multiply-add (the values do not depend on whether the CPU
    # has FMA); errno and FP traps are not used, which lets the compiler vectorise the selects.
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
    "-Wno-deprecated-declarations", "-Wno-interference-size",
]
_COMPILE_TIMEOUT_S = 300

_lock = threading.Lock()
_module: Any = None
_status = "not loaded yet"
_tried = False
_enabled_override: Optional[bool] = None
_xla_target: list = []  # [True] once a library that registers the XLA custom-call target loaded
_log = logging.getLogger("tf_dp")


def set_enabled(enabled: Optional[bool]) -> None:
    """Uses the native op (True), the TensorFlow ops (False), or decides from the environment
    (None, the default: native unless ``TF_DP_NATIVE=0``). Takes effect for functions traced
    afterwards."""
    global _enabled_override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _enabled_override = enabled


def _enabled() -> bool:
    if _enabled_override is not None:
        return _enabled_override
    return os.environ.get("TF_DP_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


_accelerators: list = []  # [None] or ["GPU"] / ["TPU"], once known


def _accelerator() -> Optional[str]:
    """"GPU" or "TPU" if TensorFlow sees one: the noise is then drawn there by TensorFlow's own
    kernels (the native op is a CPU kernel; its output would be copied to the device)."""
    if not _accelerators:
        found = [k for k in ("GPU", "TPU") if tf.config.list_logical_devices(k)]
        _accelerators.append(found[0] if found else None)
    return _accelerators[0]


@tf.autograph.experimental.do_not_convert
def available() -> bool:
    """Whether the native op is used: enabled, no GPU or TPU, and loaded (compiling it on first
    use)."""
    return _enabled() and _accelerator() is None and _load() is not None


@tf.autograph.experimental.do_not_convert
def status() -> str:
    """Why the native op is or is not used (compiling it on first use if it would be)."""
    if not _enabled():
        return "disabled (TF_DP_NATIVE=0 or set_enabled(False))"
    if _accelerator() is not None:
        return f"not used: a {_accelerator()} is present (TensorFlow's kernels draw the noise there)"
    _load()
    return _status


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else ""


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("TF_DP_NATIVE_CACHE")
    if root:
        return pathlib.Path(root)
    return pathlib.Path.home() / ".cache" / "tf_dp" / "native"


def _xla_target_flags() -> list:
    """``["-DTF_DP_XLA_CUSTOM_CALL", <link flags>]`` where the installed TensorFlow ships XLA's
    custom-call registry (its header and ``libtensorflow_cc``, which exports it): the library then
    registers ``TfDpConvKernelGrads`` and ``TfDpChunkedGaussianNoise`` as XLA CPU custom-call
    targets too. ``[]`` otherwise."""
    include = pathlib.Path(tf.sysconfig.get_include())
    lib = pathlib.Path(tf.sysconfig.get_lib())
    cc = sorted(lib.glob("libtensorflow_cc.so.*"))
    if not (include / "xla" / "service" / "custom_call_target_registry.h").exists() or not cc:
        return []
    return ["-DTF_DP_XLA_CUSTOM_CALL", f"-L{lib}", f"-l:{cc[0].name}"]


def _build(cxx: str, xla_flags: list) -> pathlib.Path:
    """The compiled library's path (built now unless cached), with ``xla_flags``
    (:func:`_xla_target_flags` or ``[]``)."""
    compile_flags = list(tf.sysconfig.get_compile_flags())
    link_flags = list(tf.sysconfig.get_link_flags())
    compile_flags += xla_flags[:1]
    link_flags += xla_flags[1:]
    digest = hashlib.sha256()
    for part in (*(src.read_bytes() for src in _SOURCES), tf.__version__.encode(),
                 sys.version.encode(), _compiler_version(cxx).encode(), " ".join(_FLAGS + compile_flags + link_flags)
                 .encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    cache = _cache_dir()
    target = cache / f"gaussian_noise_{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, *(str(src) for src in _SOURCES), "-o", tmp, *compile_flags,
               *link_flags]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each write their own temp file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@tf.autograph.experimental.do_not_convert
def _load() -> Any:
    global _module, _status, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            cxx = os.environ.get("CXX", "g++")
            if shutil.which(cxx) is None:
                raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set CXX, or install g++)")
            xla_flags = _xla_target_flags()
            try:
                path = _build(cxx, xla_flags)
            except RuntimeError as e:
                if not xla_flags:
                    raise
                # the XLA target is an extra: without it the ops still build and load
                _log.warning("tf_dp: building the native ops with the XLA custom-call target "
                             "failed (%s); building them without it", e)
                xla_flags = []
                path = _build(cxx, xla_flags)
            module = tf.load_op_library(str(path))
            tf.no_gradient("TfDpGaussianNoise")
            tf.no_gradient("TfDpBoxMuller")
            tf.no_gradient("TfDpChunkedGaussianNoise")
            tf.no_gradient("TfDpConvKernelGrads")
            _module, _status = module, f"loaded {path}"
            _xla_target[:] = [bool(xla_flags)]
        except Exception as e:  # noqa: BLE001 - any failure falls back to the TF ops
            _module, _status = None, f"unavailable: {e}"
            _log.warning(
                "tf_dp: the native noise op is unavailable (%s); drawing noise with TensorFlow "
                "ops (same words and formula, about 4x slower)", e,
            )
        _tried = True
    return _module


def _required() -> Any:
    """The loaded library; raises (saying why) where it is not available."""
    module = _load()
    if module is None:
        raise RuntimeError(f"the native ops are {status()}")
    return module


@tf.autograph.experimental.do_not_convert
def gaussian_noise_op(key: Any, counter: Any, planes: Any, num_pairs: Any, scale: Any) -> Any:
    """``2 num_pairs`` float32 normals from the Philox words at ``key`` (uint64 ``[1]``) and
    ``counter`` (uint64 ``[2]``) plus ``[0, planes[p]]`` for the high words, the angles and the
    low words (uint64 ``[3]``), radius scale ``scale = -2 stddev^2``; the layout of
    :func:`tf_dp.dp_query.noise.box_muller_lazy`'s output. Requires :func:`available`."""
    return _required().tf_dp_gaussian_noise(
        key=key, counter=counter, planes=planes, num_pairs=num_pairs, scale=scale
    )


@tf.autograph.experimental.do_not_convert
def add_gaussian_noise_op(x: Any, key: Any, counter: Any, chunk: Any, scale: Any) -> Any:
    """``x`` (float32, any shape) plus the normals of a lazy float32 draw of ``x``'s size in
    chunks of ``chunk`` elements (a multiple of 16384) at ``key`` and ``counter``: chunk ``j`` of
    ``C`` reads planes ``j``, ``C + j``, ``2C + j``, as :func:`gaussian_noise_op` called chunk by
    chunk and the chunks concatenated (:func:`tf_dp.dp_query.noise.gaussian_noise`), added in
    ``x``'s flat order. One op instead of a draw per chunk, a concatenation and an addition;
    the output may reuse ``x``'s buffer. Requires :func:`available`."""
    return _required().tf_dp_add_gaussian_noise(
        x=x, key=key, counter=counter, chunk=chunk, scale=scale
    )


@tf.autograph.experimental.do_not_convert
def chunked_gaussian_noise_op(n: Any, key: Any, counter: Any, chunk: Any, scale: Any) -> Any:
    """The ``n`` float32 normals that :func:`add_gaussian_noise_op` adds (the same chunks and
    planes), as one ``[n]`` output: no per-chunk calls, no concatenation. Requires
    :func:`available`."""
    return _required().tf_dp_chunked_gaussian_noise(
        n=n, key=key, counter=counter, chunk=chunk, scale=scale
    )


@tf.RegisterGradient("TfDpAddGaussianNoise")
def _add_gaussian_noise_grad(op: Any, dy: Any) -> list:
    """The noise does not depend on ``x``: ``dy/dx`` is the identity (as through ``x + z``)."""
    return [dy, None, None, None, None]


@tf.RegisterGradient("TfDpExtractPatches")
def _extract_patches_grad(op: Any, dy: Any) -> Any:
    """The gradient of the same ``tf.image.extract_patches`` (a sum of each patch value back
    into its pixel)."""
    x = op.inputs[0]
    attrs = [[1, *op.get_attr(k), 1] for k in ("ksizes", "strides", "rates")]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.image.extract_patches(x, *attrs, padding=op.get_attr("padding").decode())
    return tape.gradient(y, x, output_gradients=dy)


@tf.autograph.experimental.do_not_convert
def box_muller_op(hi: Any, lo: Any, angle: Any, scale: Any = -2.0) -> Any:
    """The native transform on given words (uint32 ``[h]`` each; ``lo`` is read where
    ``hi < 2^24``): ``[2 h]`` float32, as :func:`tf_dp.dp_query.noise.box_muller` on
    ``[hi, lo, angle]`` up to the last bits. For tests of the transform. Requires
    :func:`available`."""
    return _required().tf_dp_box_muller(hi=hi, lo=lo, angle=angle, scale=scale)


def _output_size(n: int, k: int, s: int, d: int, padding: str) -> int:
    """Output positions along an axis of ``n`` (window ``k``, stride ``s``, dilation ``d``,
    ``"SAME"`` or ``"VALID"`` padding), as TensorFlow's convolutions count them."""
    if padding == "SAME":
        return -(-n // s)
    return max((n - ((k - 1) * d + 1)) // s + 1, 0)


@tf.autograph.experimental.do_not_convert
def extract_patches_op(x: Any, sizes: Any, strides: Any, rates: Any, padding: str) -> Any:
    """``tf.image.extract_patches(x, [1, *sizes, 1], [1, *strides, 1], [1, *rates, 1],
    padding)`` for ``x [B, H, W, C]`` (float16/32/64, bfloat16) as one copy pass
    (``TfDpExtractPatches``, ``patches_op.cc``): the same values bit for bit, faster than
    TensorFlow's kernel and than a one-hot convolution or a gather (the ghost convolution rule's
    unfold; ``bench/README.md``). Static output sizes when ``x``'s are static; the gradient is
    ``tf.image.extract_patches``'s. Requires :func:`available`.

    Example::

        x = tf.random.normal([2, 28, 28, 1])
        p = extract_patches_op(x, (8, 8), (2, 2), (1, 1), "SAME")   # [2, 14, 14, 64]
    """
    padding = padding.upper()
    out = _required().tf_dp_extract_patches(x=x, ksizes=list(sizes), strides=list(strides),
                                       rates=list(rates), padding=padding)
    shape = [x.shape[0]]
    for n, k, s, d in zip(x.shape[1:3], sizes, strides, rates):
        shape.append(None if n is None else _output_size(n, k, s, d, padding))
    c = x.shape[3]
    shape.append(None if c is None else sizes[0] * sizes[1] * c)
    out.set_shape(shape)
    return out


@tf.autograph.experimental.do_not_convert
def conv_kernel_grads_op(x: Any, g: Any, sizes: Any, strides: Any, rates: Any,
                         padding: str) -> Any:
    """Per-example gradients ``[B, kh * kw * C, F]`` of a 2-D convolution's ``[kh, kw, C, F]``
    kernel, from the float32 input ``x [B, H, W, C]`` and output gradient ``g [B, OH, OW, F]``
    (channels last; strides, dilation ``rates`` and ``"SAME"``/``"VALID"`` padding as
    ``tf.nn.conv2d`` takes them): ``sum_t patches[b, t]^T g[b, t]`` with the patches of
    :func:`extract_patches_op`, in one op that never writes the patches
    (``TfDpConvKernelGrads``, ``patches_op.cc``). Float32 sums, equal to the patches' matrix
    product up to rounding. Static shapes when ``x``'s and ``g``'s are static. No gradient.
    Requires :func:`available`.

    Example::

        x = tf.random.normal([2, 28, 28, 1])
        g = tf.random.normal([2, 14, 14, 16])
        grads = conv_kernel_grads_op(x, g, (8, 8), (2, 2), (1, 1), "SAME")   # [2, 64, 16]
    """
    out = _required().tf_dp_conv_kernel_grads(
        x=x, g=g, ksizes=list(sizes), strides=list(strides), rates=list(rates),
        padding=padding.upper())
    c, f = x.shape[3], g.shape[3]
    out.set_shape([x.shape[0], None if c is None else sizes[0] * sizes[1] * c, f])
    return out


@tf.autograph.experimental.do_not_convert
def xla_available() -> bool:
    """Whether :func:`conv_kernel_grads_xla` and :func:`chunked_gaussian_noise_xla` can be used:
    :func:`available`, and the library registered its XLA CPU custom-call targets (the installed
    TensorFlow ships XLA's custom-call registry; ``_xla_target_flags``)."""
    return available() and bool(_xla_target) and _xla_target[0]


@tf.autograph.experimental.do_not_convert
def conv_kernel_grads_xla(x: Any, g: Any, sizes: Any, strides: Any, rates: Any,
                          padding: str) -> Any:
    """:func:`conv_kernel_grads_op` inside a function compiled with XLA (``jit_compile=True``),
    where TensorFlow's kernels cannot run: an XLA custom call (``XlaCustomCallV2``) to the
    library's CPU target ``TfDpConvKernelGrads``, the same computation (the same float32 sums in
    the same order, so the same values bit for bit). Needs static shapes for ``x`` and ``g``
    (the call's result shape is fixed when the function is traced; the ghost rule keeps its
    patches' route otherwise) and :func:`xla_available`. The examples are split over one thread
    per CPU the process may use. No gradient.

    Example::

        @tf.function(jit_compile=True)
        def grads(x, g):
            return conv_kernel_grads_xla(x, g, (8, 8), (2, 2), (1, 1), "SAME")

        grads(tf.random.normal([2, 28, 28, 1]), tf.random.normal([2, 14, 14, 16]))  # [2, 64, 16]
    """
    from tensorflow.compiler.tf2xla.python import xla as tf2xla

    if not xla_available():
        raise RuntimeError(f"the native XLA target is not available ({status()})")
    if x.dtype != tf.float32 or g.dtype != tf.float32:
        raise TypeError(f"x and g must be float32, got {x.dtype.name} and {g.dtype.name}")
    if not (x.shape.is_fully_defined() and g.shape.is_fully_defined()) or x.shape.rank != 4 \
            or g.shape.rank != 4:
        raise ValueError(f"x and g must have static rank-4 shapes, got {x.shape} and {g.shape}")
    sizes, strides, rates = [list(map(int, v)) for v in (sizes, strides, rates)]
    if any(len(v) != 2 or min(v) < 1 for v in (sizes, strides, rates)):
        raise ValueError(f"sizes, strides and rates must be 2 integers >= 1, got {sizes}, "
                         f"{strides}, {rates}")
    padding = padding.upper()
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    b, h, w, c = x.shape.as_list()
    out = [_output_size(n, k, s, d, padding) for n, k, s, d in zip((h, w), sizes, strides, rates)]
    f = g.shape[3]
    if g.shape.as_list() != [b, *out, f]:
        raise ValueError(f"g must be {[b, *out, 'F']} for x of shape {x.shape} and this "
                         f"convolution, got {g.shape}")
    config = " ".join(str(v) for v in (b, h, w, c, *sizes, *strides, *rates,
                                        int(padding == "SAME"), f))
    spec = tf.TensorSpec([b, sizes[0] * sizes[1] * c, f], tf.float32)
    return tf2xla.custom_call_v2("TfDpConvKernelGrads", [x, g], [spec],
                                 backend_config=config)[0]


@tf.autograph.experimental.do_not_convert
def chunked_gaussian_noise_xla(n: int, key: Any, counter: Any, chunk: int, scale: Any) -> Any:
    """:func:`chunked_gaussian_noise_op` inside a function compiled with XLA: an XLA custom call
    (``XlaCustomCallV2``) to the library's CPU target ``TfDpChunkedGaussianNoise``, the same
    normals bit for bit from the same words. ``n`` and ``chunk`` are Python integers (the call's
    shape is fixed when traced; ``chunk`` a positive multiple of 16384); ``key`` uint64 ``[1]``,
    ``counter`` uint64 ``[2]``, ``scale`` float32 ``[]`` (``-2 stddev^2``). One thread: the draw
    depends on nothing else in a step, so XLA runs it beside the step's other work. Requires
    :func:`xla_available`.

    Example::

        @tf.function(jit_compile=True)
        def draw(key, counter):
            return chunked_gaussian_noise_xla(100_000, key, counter, 1 << 20, tf.constant(-2.0))

        draw(tf.constant([7], tf.uint64), tf.constant([0, 1], tf.uint64))   # [100000] normals
    """
    from tensorflow.compiler.tf2xla.python import xla as tf2xla

    if not xla_available():
        raise RuntimeError(f"the native XLA target is not available ({status()})")
    n, chunk = int(n), int(chunk)
    if not 0 <= n <= 1 << 41:
        raise ValueError(f"n must be in [0, 2^41], got {n}")
    if chunk <= 0 or chunk % 16384:
        raise ValueError(f"chunk must be a positive multiple of 16384, got {chunk}")
    if n == 0:
        return tf.zeros([0], tf.float32)
    key = tf.reshape(tf.convert_to_tensor(key, tf.uint64), [1])
    counter = tf.reshape(tf.convert_to_tensor(counter, tf.uint64), [2])
    scale = tf.reshape(tf.cast(scale, tf.float32), [])
    return tf2xla.custom_call_v2(
        "TfDpChunkedGaussianNoise", [key, counter, scale], [tf.TensorSpec([n], tf.float32)],
        backend_config=f"{n} {chunk}")[0]
