"""A round's tokens into a request's output: trimmed at EOS, stop ids, stop strings and limits,
detokenized incrementally."""

from __future__ import annotations

from flashtree.engine.sequence import Request, TokenLogprob
from flashtree.engine.stops import StopHit, StopMatcher, StopStrings


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
                stops = self.matcher(req)
                # Held-back text (a partial character at the end) may already complete a stop;
                # it is read without moving the matcher, which reads it once it is final.
                if offsets is not None:
                    seen, hit = text, stops.feed(delta)
                else:
                    seen = req.text + self.detokenize(req, new, final=True)[0]
                    hit = stops.feed(seen[len(req.text):], commit=False)
                if hit is not None:
                    new, text, reason = self._stop_token(req, new, seen, hit), seen[: hit.start], "stop"
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

    def matcher(self, req: Request) -> StopMatcher:
        """req's stop-string matcher, made on first use; a group's samples share the automaton."""
        if req.stops is None:
            others = req.group.samples if req.group is not None else []
            strings = next((s.stops.strings for s in others if s.stops is not None), None)
            req.stops = StopMatcher(strings or StopStrings(req.params.stop))
        return req.stops

    def _stop_token(self, req: Request, new: list[int], seen: str, hit: StopHit) -> list[int]:
        """The shortest head of `new` whose text completes the stop string at seen[hit.start:hit.end]."""
        for j in range(1, len(new)):
            head = req.text + self.detokenize(req, new[:j], final=True)[0]
            if head[hit.start: hit.end] == seen[hit.start: hit.end]:
                return new[:j]
        return new
