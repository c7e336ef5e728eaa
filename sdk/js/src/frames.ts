/**
 * The one wire format of cpuos (cpuos_agent.protocol), as the daemon sends exec output and
 * framed file reads (`application/x-cpuos-frames`):
 *
 *     u32 header_len | u32 payload_len | header (UTF-8 JSON object with a string "t") | payload
 *
 * (big-endian). Checked against tests/vectors/exec_frames.json, like the Python decoder.
 */
export const CONTENT_TYPE = "application/x-cpuos-frames";
export const MAX_HEADER = 64 * 1024;
export const MAX_PAYLOAD = 4 * 1024 * 1024;
const PREFIX_LEN = 8;

export type FrameHeader = { t: string } & Record<string, unknown>;
export interface Frame {
  header: FrameHeader;
  payload: Uint8Array;
}

/** The peer sent something that is not a valid frame. */
export class ProtocolError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "ProtocolError";
  }
}

const utf8 = new TextEncoder();
const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

export function encodeFrame(header: FrameHeader, payload: Uint8Array = new Uint8Array()):
    Uint8Array {
  // non-ASCII escaped as \uXXXX, as Python's json.dumps does: the same bytes either side
  const h = utf8.encode(JSON.stringify(header).replace(
    /[\u0080-\uffff]/g, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0")));
  if (h.length > MAX_HEADER) throw new ProtocolError(`header too large (${h.length} bytes)`);
  if (payload.length > MAX_PAYLOAD) {
    throw new ProtocolError(`payload too large (${payload.length} bytes)`);
  }
  const out = new Uint8Array(PREFIX_LEN + h.length + payload.length);
  const view = new DataView(out.buffer);
  view.setUint32(0, h.length);
  view.setUint32(4, payload.length);
  out.set(h, PREFIX_LEN);
  out.set(payload, PREFIX_LEN + h.length);
  return out;
}

function parseHeader(raw: Uint8Array): FrameHeader {
  let h: unknown;
  try {
    h = JSON.parse(strictUtf8.decode(raw));
  } catch (e) {
    throw new ProtocolError(`header is not JSON: ${(e as Error).message}`);
  }
  if (typeof h !== "object" || h === null || Array.isArray(h) ||
      typeof (h as { t?: unknown }).t !== "string") {
    throw new ProtocolError("header must be an object with a string 't'");
  }
  return h as FrameHeader;
}

/** Incremental decoder: feed bytes, get complete frames. Memory is bounded by one frame. */
export class FrameDecoder {
  private buf: Uint8Array = new Uint8Array(0);
  private len = 0;

  feed(data: Uint8Array): Frame[] {
    if (data.length) {
      if (this.len + data.length > this.buf.length) {
        const grown = new Uint8Array(Math.max(this.len + data.length, this.buf.length * 2));
        grown.set(this.buf.subarray(0, this.len));
        this.buf = grown;
      }
      this.buf.set(data, this.len);
      this.len += data.length;
    }
    const out: Frame[] = [];
    const buf = this.buf;
    const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
    let pos = 0;
    while (this.len - pos >= PREFIX_LEN) {
      const hlen = view.getUint32(pos);
      const plen = view.getUint32(pos + 4);
      if (hlen === 0 || hlen > MAX_HEADER) throw new ProtocolError(`bad header length ${hlen}`);
      if (plen > MAX_PAYLOAD) throw new ProtocolError(`bad payload length ${plen}`);
      const end = pos + PREFIX_LEN + hlen + plen;
      if (end > this.len) break;
      const hstart = pos + PREFIX_LEN;
      const header = parseHeader(buf.subarray(hstart, hstart + hlen));
      out.push({ header, payload: buf.slice(hstart + hlen, end) });
      pos = end;
    }
    if (pos) {
      buf.copyWithin(0, pos, this.len);
      this.len -= pos;
      if (this.buf.length > 1 << 20 && this.len < this.buf.length >> 2) {
        this.buf = this.buf.slice(0, Math.max(this.len, 1 << 16));  // give memory back
      }
    }
    return out;
  }

  /** Bytes of an incomplete frame held. */
  get pending(): number {
    return this.len;
  }
}
