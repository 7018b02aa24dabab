"""Which config values are secrets, and the config with them masked (config.yaml, anything printed).

A string value is masked when its key names a secret or when it is a URL carrying a
password (numbers and booleans such as `loss.token_accuracy` are never secrets):
- key: the words of its last dotted part (split at '_') include token, secret, password,
  passwd, credential(s) or apikey, or its last word is key/keys (`hf_token`, `wandb_api_key`,
  `access_key`), except the keys naming dataset columns (`data.messages_key` ...), whose values
  are column names. `data.max_tokens_per_micro_batch` is no secret: 'tokens' is not 'token'.
- URL: `scheme://user:password@host...` (e.g. a ray.address) keeps everything but the password.
Credentials belong in the environment (WANDB_API_KEY, HF_TOKEN, ...), which hpsft never writes.
"""

import re

MASK = "***"
SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "apikey"}
COLUMN_NAME_KEYS = {f"data.{name}_key" for name in ("messages", "role", "content", "prompt", "query", "response",
                                                    "system", "history", "tools")}
URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)[^/@\s]+(?P<tail>@)")


def is_secret_key(dotted_key: str) -> bool:
    if dotted_key in COLUMN_NAME_KEYS:
        return False
    words = dotted_key.rsplit(".", 1)[-1].lower().split("_")
    return bool(SECRET_WORDS.intersection(words)) or words[-1] in ("key", "keys")


def mask_secrets(value, dotted_key: str = ""):
    """`value` (a config as nested dicts/lists) with every secret replaced by MASK."""
    if isinstance(value, dict):
        return {key: mask_secrets(item, f"{dotted_key}.{key}" if dotted_key else str(key))
                for key, item in value.items()}
    if isinstance(value, list):
        return [mask_secrets(item, dotted_key) for item in value]
    if not isinstance(value, str):
        return value
    return MASK if is_secret_key(dotted_key) else URL_PASSWORD.sub(rf"\g<head>{MASK}\g<tail>", value)
