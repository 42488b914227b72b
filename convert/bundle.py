"""The path `loopspec convert bundle` imports the bundle builder from; the serving bundles are the
package loopspec.convert.bundles (one module per serving framework)."""

from loopspec.convert.bundles import FRAMEWORKS, build_bundle  # noqa: F401

ENGINE_NAMES = {name: framework.title for name, framework in FRAMEWORKS.items()}  # the titles it prints
