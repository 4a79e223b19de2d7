"""Configuration: one YAML file, environment overrides, secrets from files.

The whole file is validated at start-up. The core sections are modelled here;
each plugin declares the model of its own `plugins.<name>` section through the
`pushgw_config_model` hook, and `validate_plugin_section` checks it with the
same rules (unknown keys are errors, `*_file` keys read secrets from files).

Environment variables `PUSHGW__SECTION__KEY` override the file (`environment_overrides`);
provider credentials (APNs keys and certificates, FCM service accounts) are loaded here
too (`ApnsAppConfig.check_credentials`, `FcmAppConfig.check_credentials`), so that
`pushgw check-config` and a start share one validation path and one set of loaders.

Errors name the file (or the environment variable) and the key path, never a secret,
and the CLI exits with status 2.

The package, each module importing only from those above it in this list:

- `errors`: `ConfigError`, `config_error`, which names the key path and the file
  or environment variable it came from, and `bad_hook_result`, a plugin hook's
  result that is not what the hook returns.
- `proxy`: the proxy of the provider clients (`delivery.proxy`, else `HTTPS_PROXY`) and
  `proxy_problem`, which `Settings` and `load_settings` check it with.
- `base`: `ConfigModel` (the base of every section model, `X_file` secrets) and the
  `ExistingFile` / `TrustStore` / `HomePath` path types (`~` expanded: `expand_home`).
- `apps`: the provider apps (`ApnsAppConfig`, `FcmAppConfig`) and their credential
  loaders (`CredentialError`).
- `sections`: the core sections and `Settings`, the model of the whole file.
- `env`: the `PUSHGW__...` environment overrides (`environment_overrides`).
- `loading`: `load_settings` (file + environment) and `validate_plugin_section`.
- `masking`: the config with its secrets masked (`masked`, `mask_url`).

Import from `gateway.config`; the names below are its interface. (To patch a
function for a test, patch it in the module that calls it.)
"""

from gateway.config.apps import (
    ApnsAppConfig,
    AppConfig,
    CredentialError,
    FcmAppConfig,
    ServiceAccount,
)
from gateway.config.base import (
    ConfigModel,
    ExistingFile,
    HomePath,
    TrustStore,
    expand_home,
    read_secret_file,
)
from gateway.config.env import ENV_PREFIX, EnvOverrides, environment_overrides
from gateway.config.errors import ConfigError, Problem, bad_hook_result, config_error
from gateway.config.loading import (
    CONFIG_ENV,
    config_path,
    load_settings,
    read_yaml,
    validate_plugin_section,
    yaml_document,
)
from gateway.config.masking import MASK, mask_url, masked
from gateway.config.sections import (
    DEVELOPMENT_HMAC_KEY,
    SUPPORTED_DATABASES,
    CircuitBreakerConfig,
    DeliveryConfig,
    EventLoop,
    LoggingConfig,
    Origins,
    PluginsSection,
    ReceiptsConfig,
    ReceiptsFormat,
    ServerConfig,
    Settings,
    StoreConfig,
)

__all__ = [
    "CONFIG_ENV",
    "DEVELOPMENT_HMAC_KEY",
    "ENV_PREFIX",
    "MASK",
    "SUPPORTED_DATABASES",
    "ApnsAppConfig",
    "AppConfig",
    "CircuitBreakerConfig",
    "ConfigError",
    "ConfigModel",
    "CredentialError",
    "DeliveryConfig",
    "EnvOverrides",
    "EventLoop",
    "ExistingFile",
    "FcmAppConfig",
    "HomePath",
    "LoggingConfig",
    "Origins",
    "PluginsSection",
    "Problem",
    "ReceiptsConfig",
    "ReceiptsFormat",
    "ServerConfig",
    "ServiceAccount",
    "Settings",
    "StoreConfig",
    "TrustStore",
    "bad_hook_result",
    "config_error",
    "config_path",
    "environment_overrides",
    "expand_home",
    "load_settings",
    "mask_url",
    "masked",
    "read_secret_file",
    "read_yaml",
    "validate_plugin_section",
    "yaml_document",
]
