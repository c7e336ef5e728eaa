/** Output handling for exec: a bounded buffer per stream and a line splitter. */

export const DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024;
/** A line longer than this (in characters) is handed on in pieces of this size. */
export const MAX_LINE = 1024 * 1024;

/** Keeps at most `cap` bytes of a stream: the head and the tail, and says if it cut. */
export class OutputBuffer {
  readonly cap: number;
  private head: Uint8Array[] = [];
  private headLen = 0;
  private tail: Uint8Array[] = [];
  private tailLen = 0;
  total = 0;

  constructor(cap: number = DEFAULT_MAX_OUTPUT) {
    this.cap = Math.max(0, Math.floor(cap));
  }

  add(data: Uint8Array): void {
    this.total += data.length;
    const room = Math.floor(this.cap / 2) - this.headLen;
    if (room > 0) {
      const part = data.subarray(0, room);
      this.head.push(part);
      this.headLen += part.length;
      data = data.subarray(room);
    }
    if (!data.length) return;
    this.tail.push(data);
    this.tailLen += data.length;
    const limit = this.cap - Math.floor(this.cap / 2);
    while (this.tail.length && this.tailLen - (this.tail[0] as Uint8Array).length >= limit) {
      this.tailLen -= (this.tail.shift() as Uint8Array).length;
    }
  }

  private get tailKeep(): number {
    return Math.min(this.tailLen, this.cap - Math.floor(this.cap / 2));
  }

  get truncated(): boolean {
    return this.total > this.headLen + this.tailKeep;
  }

  value(): Uint8Array {
    const tail = concat(this.tail);
    return concat([...this.head, tail.subarray(tail.length - this.tailKeep)]);
  }
}

export function concat(parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.length;
  const out = new Uint8Array(n);
  let pos = 0;
  for (const p of parts) {
    out.set(p, pos);
    pos += p.length;
  }
  return out;
}

/**
 * Bytes in, text out: decoded as UTF-8 across chunk boundaries (invalid bytes replaced),
 * then either as it comes (`lines` false) or one line at a time, without its newline (and a
 * CR before it); the last line is handed on at the end even without a newline.
 */
export class TextSplitter {
  private decoder = new TextDecoder("utf-8");
  private pending = "";

  constructor(private readonly lines: boolean, private readonly maxLine: number = MAX_LINE) {}

  feed(data: Uint8Array): string[] {
    return this.split(this.decoder.decode(data, { stream: true }), false);
  }

  end(): string[] {
    return this.split(this.decoder.decode(), true);
  }

  private split(text: string, final: boolean): string[] {
    if (!this.lines) return text ? [text] : [];
    const out: string[] = [];
    let s = this.pending + text;
    let nl = s.indexOf("\n");
    while (nl >= 0) {
      out.push(s.endsWith("\r", nl) ? s.slice(0, nl - 1) : s.slice(0, nl));
      s = s.slice(nl + 1);
      nl = s.indexOf("\n");
    }
    while (s.length > this.maxLine) {
      out.push(s.slice(0, this.maxLine));
      s = s.slice(this.maxLine);
    }
    if (final && s) {
      out.push(s);
      s = "";
    }
    this.pending = s;
    return out;
  }
}
