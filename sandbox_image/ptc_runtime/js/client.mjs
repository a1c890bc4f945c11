// The broker client of a JavaScript or TypeScript script: the same wire format as the Python runtime's
// (ptc_runtime/client.py): one JSON request per line, {"id": n, "tool": name, "args": {...}}, answered in any order by
// {"id": n, "ok": true, "result": ...} or {"id": n, "ok": false, "error": {"type", "message"}}; besides calls, one
// {"id": n, "op": "report", "error": {...}} describes a script that ended with an uncaught exception.
//
// One connection per process, made at the first call; many calls may be in flight at once (Promise.all). The
// connection keeps the process alive only while a call waits for its reply, so a script whose work is done ends as
// `node script.mjs` would. What this module uses of the language is taken when it loads, before the script runs: a
// script that replaces JSON.stringify, Promise or Map later cannot change how its calls are sent or matched.
//
// Numbers: an integer a reply holds beyond Number.MAX_SAFE_INTEGER (2^53 - 1) arrives as a BigInt, never rounded;
// a BigInt argument is sent as that exact integer; NaN and the infinities, which JSON cannot carry, are refused
// (ToolError "invalid_arguments") rather than sent as null as JSON.stringify would.
import net from "node:net";

const SOCKET_PATH = "/run/ptc/tools.sock";
const { parse, stringify } = JSON;
const { isSafeInteger, isFinite } = Number;
const BigIntOf = BigInt;
const SafeMap = Map;
const randomTag = () => `\u0000ptc-${Math.random().toString(36).slice(2)}-${Date.now()}:`;
const replaceAll = (text, pattern, fn) => String.prototype.replace.call(text, pattern, fn);
const startsWith = (text, prefix) => String.prototype.startsWith.call(text, prefix);
const sliceOf = (text, from) => String.prototype.slice.call(text, from);
const isArray = Array.isArray;

export class ToolError extends Error {
  // A tool call that did not return a result: `type` is a short machine-readable kind (rejected, unknown_tool,
  // timeout, http_error, endpoint_error, denied, broker_unavailable, invalid_arguments, ...), `message` says why,
  // `tool` names the tool when known.
  constructor(type, message, tool) {
    super(message);
    this.name = "ToolError";
    this.type = type;
    if (tool !== undefined) this.tool = tool;
  }
}

// A JSON token: a string (skipped whole, escapes included) or a number.
const TOKENS = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g;
const INTEGER = /^-?\d+$/;

export function parseExact(text) {
  // JSON.parse, except that an integer beyond the safe range becomes a BigInt (exact) instead of a rounded Number.
  let tag = null;
  const marked = replaceAll(text, TOKENS, (token) => {
    if (token[0] === '"' || !INTEGER.test(token) || isSafeInteger(+token)) return token;
    tag ??= randomTag();
    return stringify(tag + token);
  });
  if (tag === null) return parse(text);
  return parse(marked, (key, value) =>
    typeof value === "string" && startsWith(value, tag) ? BigIntOf(sliceOf(value, tag.length)) : value,
  );
}

export function stringifyExact(value) {
  // JSON.stringify, with a BigInt written as its exact integer; NaN and the infinities refused (TypeError).
  let tag = null;
  const text = stringify(value, (key, item) => {
    if (typeof item === "bigint") {
      tag ??= randomTag();
      return tag + item.toString();
    }
    if (typeof item === "number" && !isFinite(item)) throw new TypeError(`${item} is not a JSON number`);
    return item;
  });
  if (tag === null) return text;
  const quoted = stringify(tag).slice(0, -1); // the tag as it appears inside a JSON string, without the closing quote
  return replaceAll(text, new RegExp(`${quoted.replace(/[\\^$.*+?()[\]{}|]/g, "\\$&")}(-?\\d+)"`, "g"), (_, n) => n);
}

let socket = null;
let closedReason = null;
let nextId = 1;
let unread = "";
const pending = new SafeMap(); // id -> {resolve, tool}

function lost(reason) {
  if (closedReason === null) closedReason = reason;
  const waiting = [...pending.values()];
  pending.clear();
  for (const waiter of waiting) waiter.resolve({ ok: false, error: { type: "broker_unavailable", message: reason } });
  if (socket !== null) socket.unref();
}

function connect() {
  socket = net.createConnection(SOCKET_PATH);
  socket.setEncoding("utf8");
  socket.unref();
  socket.on("data", (chunk) => {
    const lines = (unread + chunk).split("\n");
    unread = lines.pop();
    for (const line of lines) {
      let reply;
      try {
        reply = parseExact(line);
      } catch (exc) {
        lost(`unreadable reply from the broker: ${exc}`);
        socket.destroy();
        return;
      }
      const waiter = reply !== null && typeof reply === "object" ? pending.get(reply.id) : undefined;
      if (waiter === undefined) continue;
      pending.delete(reply.id);
      waiter.resolve(reply);
    }
    if (pending.size === 0) socket.unref();
  });
  socket.on("error", (exc) => lost(`cannot reach the broker at ${SOCKET_PATH}: ${exc.message}`));
  socket.on("close", () => lost("the broker closed the connection"));
}

export function request(body) {
  // Send one request; a promise of its reply object ({ok, result} or {ok: false, error}). Never rejects.
  let payload;
  try {
    payload = stringifyExact(body);
  } catch (exc) {
    const message = `arguments are not JSON-serializable: ${exc.message}`;
    return Promise.resolve({ ok: false, error: { type: "invalid_arguments", message } });
  }
  if (socket === null) connect();
  if (closedReason !== null) {
    return Promise.resolve({ ok: false, error: { type: "broker_unavailable", message: closedReason } });
  }
  const id = nextId++;
  return new Promise((resolve) => {
    pending.set(id, { resolve });
    socket.ref();
    socket.write(`{"id":${id},${payload.slice(1)}\n`);
  });
}

export async function call(tool, args) {
  // One tool call: its result, or a rejection with a ToolError.
  if (args === undefined) args = {};
  if (args === null || typeof args !== "object" || isArray(args)) {
    throw new ToolError("invalid_arguments", `${tool} takes one object of arguments, e.g. {name: value}`, tool);
  }
  const reply = await request({ tool, args });
  if (reply.ok === true) return reply.result;
  const error = reply.error !== null && typeof reply.error === "object" ? reply.error : {};
  throw new ToolError(String(error.type ?? "error"), String(error.message ?? ""), tool);
}
