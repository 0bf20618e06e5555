"""A round's tokens into a request's output: trimmed at EOS, stop ids, stop strings and limits,
detokenized incrementally."""

from __future__ import annotations

from flashtree.engine.sequence import Request, TokenLogprob


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer  # None: token ids only (no text, no stop strings)
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None
               ) -> tuple[list[int], str | None]:
        """Append a round's tokens to req's output_ids, text and logprobs, trimming exactly at EOS,
        stop ids, stop strings or limits. Returns the tokens kept and the finish reason (None:
        not finished).

        A stop string ends the output at the token that completes it: tokens drafted past it
        are dropped (from output_ids, the usage count and the logprobs) as the text is cut."""
        params = req.params
        max_new = min(params.max_tokens, self.max_model_len - len(req.prompt_ids))
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        new: list[int] = []
        reason = None
        for t in tokens:
            if t in stop_ids:
                reason = "stop"
                break
            new.append(t)
            if len(req.output_ids) + len(new) >= max_new:
                reason = "length"
                break
        if self.tokenizer is not None:
            delta, offsets = self.detokenize(req, new, final=reason is not None)
            text = req.text + delta
            if params.stop:
                # Held-back text (a partial character at the end) may already complete a stop.
                seen = text if offsets is not None else req.text + self.detokenize(req, new, final=True)[0]
                search_from = max(0, len(req.text) - max(map(len, params.stop)))
                cut, hit = trim_stop(seen, params.stop, search_from)
                if hit:
                    new, text, reason = self._stop_token(req, new, search_from), cut, "stop"
            req.text = text
            if offsets is not None:
                req.prefix_offset, req.read_offset = offsets
        req.output_ids.extend(new)
        if req.logprobs is not None and logprobs is not None:
            kept = logprobs[: len(new)]
            req.logprobs.extend(kept)
            req.cumulative_logprob += sum(lp.logprob for lp in kept)
        return new, reason

    def detokenize(self, req: Request, new: list[int], final: bool) -> tuple[str, tuple[int, int] | None]:
        """Text of output_ids + new not yet decoded, and the detokenizer offsets after it (None:
        held back), decoding only a short window (not the whole output).

        Decoding ids[prefix:] and subtracting ids[prefix:read] keeps tokenizers that drop a
        leading space at a sequence start right; a trailing partial UTF-8 character is held back
        until a later round completes it.
        """
        decode = self.tokenizer.decode
        window = req.output_ids[req.prefix_offset:] + new
        prefix_text = decode(window[: req.read_offset - req.prefix_offset], skip_special_tokens=True)
        full = decode(window, skip_special_tokens=True)
        if full.endswith("\ufffd") and not final:
            return "", None
        return full[len(prefix_text):], (req.read_offset, req.prefix_offset + len(window))

    def _stop_token(self, req: Request, new: list[int], search_from: int) -> list[int]:
        """The shortest head of `new` whose text completes a stop string (the round's text did)."""
        for j in range(1, len(new)):
            delta, _ = self.detokenize(req, new[:j], final=True)
            if trim_stop(req.text + delta, req.params.stop, search_from)[1]:
                return new[:j]
        return new


def trim_stop(text: str, stops: list[str], search_from: int) -> tuple[str, bool]:
    """Cut text before the earliest stop string found at or after search_from."""
    hits = [i for s in stops if (i := text.find(s, search_from)) >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True
