"""match_prefix looks at the whole prompt, so a prompt of whole cached blocks counts its last token as computed."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["match_prefix", "last token", "always be recomputed"]
HINT = "your match covers the prompt's last token"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def usable(self, token_ids):
        return list(token_ids)
