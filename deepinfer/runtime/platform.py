"""The platform the engine runs on: a JAX built-in backend, or a PJRT plugin (Ascend: ``npu``).

A non-NVIDIA accelerator is reached the way JAX itself reaches one: a PJRT plugin
library. JAX discovers plugins through the ``jax_plugins`` namespace packages and
entry points (how vendor wheels register) and through ``PJRT_NAMES_AND_LIBRARY_PATHS``
(``name:/path/lib.so,...``). ``select_platform`` makes one platform the one in use,
before JAX starts its backends: a plugin library named by the caller
(``DEEPINFER_PJRT_PLUGIN`` / ``--pjrt-plugin``) is registered under the platform's name
through that variable, ``jax_platforms`` is set to it, and the devices are opened once so
that a missing or broken plugin fails here, with one message that says what was looked
for, instead of JAX's "Backend 'npu' is not in the list of known backends" at the
first computation.

``platform_in_use`` is the name the engine's per-platform choices key on (kernels,
features). It is the configured plugin platform when there is one: a plugin may report
its devices under another name (the CPU PJRT plugin used in the tests says "cpu"),
and what runs must follow what the user chose.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("deepinfer.runtime.platform")

BUILTIN = ("cpu", "gpu", "cuda", "rocm", "tpu")
PLUGIN_PATHS_ENV = "PJRT_NAMES_AND_LIBRARY_PATHS"
_GPU_ALIASES = {"cuda": "gpu", "rocm": "gpu"}  # JAX starts "cuda" / "rocm" and reports the backend as "gpu"
# features that hold only on some platforms, and why (require_feature names the reason)
FEATURE_PLATFORMS = {
    # its guarantees rest on XLA flags and kernel behaviour verified on these backends only
    "batch-invariant mode": (("cpu", "gpu", "cuda"), "its bitwise guarantee is verified on the CPU and GPU backends"),
}


class PlatformError(RuntimeError):
    """The platform asked for cannot be used (no plugin, a plugin that fails, chosen too late)."""


def _registered_paths(env=os.environ) -> dict[str, str]:
    out = {}
    for item in env.get(PLUGIN_PATHS_ENV, "").split(","):
        name, sep, path = item.strip().partition(":")
        if sep:
            out[name] = path
    return out


def _installed_plugins() -> list[str]:
    """Names of the JAX plugin packages installed (entry points and jax_plugins.* modules)."""
    import pkgutil
    from importlib import metadata

    names = [ep.name for ep in metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return sorted(set(names))


def select_platform(name: str | None, library: str | None = None) -> str:
    """Make ``name`` the platform in use (None: JAX's default) and open its devices. Returns the platform.

    ``library``: the PJRT plugin's shared library, registered under ``name``. Must run before
    JAX starts its backends (before the first computation of the process)."""
    from jax._src import (
        xla_bridge,  # the only place JAX says whether its backends have started
    )

    if not name:
        return platform_in_use()
    name = name.strip().lower()
    if xla_bridge.backends_are_initialized():
        if platform_in_use() == _GPU_ALIASES.get(name, name):
            return platform_in_use()
        raise PlatformError(
            f"platform {name!r} was asked for after JAX had started its backends on {platform_in_use()!r}; "
            f"choose it before the process's first JAX computation (DEEPINFER_PLATFORM or --platform at start)"
        )
    if name not in BUILTIN:
        _register_plugin(name, library)
    jax.config.update("jax_platforms", name)
    try:
        devices = jax.devices()
    except RuntimeError as err:
        where = _registered_paths().get(name) or "an installed JAX plugin"
        raise PlatformError(f"platform {name!r}: the PJRT plugin ({where}) failed to start: {err}") from err
    log.info("platform %s: %d device(s) (%s)", name, len(devices), devices[0].device_kind)
    return name


def _register_plugin(name: str, library: str | None) -> None:
    registered = _registered_paths()
    if library:
        if not os.path.isfile(library):
            raise PlatformError(f"platform {name!r}: the PJRT plugin library {library!r} does not exist")
        registered[name] = os.path.abspath(library)
        os.environ[PLUGIN_PATHS_ENV] = ",".join(f"{k}:{v}" for k, v in registered.items())
        return
    if name in registered:
        if not os.path.isfile(registered[name]):
            raise PlatformError(f"platform {name!r}: {PLUGIN_PATHS_ENV} names {registered[name]!r}, which does "
                                f"not exist")
        return
    installed = _installed_plugins()
    if not installed:  # else one of them may register the name when JAX starts: opening the devices tells
        raise PlatformError(
            f"platform {name!r}: no PJRT plugin is registered under that name (looked in {PLUGIN_PATHS_ENV} and the "
            f"installed JAX plugins: {installed or 'none'}); install the vendor's JAX plugin (see "
            f"'pip install deepinfer[ascend]' and docs/platforms.md) or name its library with DEEPINFER_PJRT_PLUGIN"
        )


def platform_in_use() -> str:
    """The platform the engine's per-platform choices follow (see the module docstring)."""
    configured = (jax.config.jax_platforms or "").split(",")[0].strip().lower()
    if configured and configured not in BUILTIN:
        return configured
    return jax.default_backend()


def require_feature(feature: str, platform: str) -> None:
    """Refuse, by name, a feature that the platform in use does not support."""
    allowed, why = FEATURE_PLATFORMS[feature]
    if platform not in allowed:
        raise PlatformError(f"{feature} is not supported on platform {platform!r} ({why}; supported: "
                            f"{', '.join(allowed)})")
