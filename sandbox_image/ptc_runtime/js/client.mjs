// The broker client of a JavaScript or TypeScript script: the same wire format as the Python runtime's
// (ptc_runtime/client.py): one JSON request per line, {"id": n, "tool": name, "args": {...}}, answered in any order by
// {"id": n, "ok": true, "result": ...} or {"id": n, "ok": false, "error": {"type", "message"}}; besides calls, one
// {"id": n, "op": "report", "error": {...}} describes a script that ended with an uncaught exception.
//
// One connection per process, made at the first call; many calls may be in flight at once (Promise.all). The
// connection keeps the process alive only while a call waits for its reply, so a script whose work is done ends as
// `node script.mjs` would.
//
// What this module uses of the language is taken when it loads, before the script runs, and called through those
// copies (as Node's own internals do: "primordials"): JSON, Promise, Map, the String and Array methods, iteration. A
// script that replaces them later (JSON.stringify, Promise, Map.prototype.get, String.prototype.slice, an array's
// iterator, the socket's methods) still has its calls sent, matched and answered as written. This is for the script's own sake, not a
// boundary: the broker's records are the authority whatever the script does in its own process.
//
// Numbers: an integer a reply holds beyond Number.MAX_SAFE_INTEGER (2^53 - 1) arrives as a BigInt, never rounded;
// a BigInt argument is sent as that exact integer; NaN and the infinities, which JSON cannot carry, are refused
// (ToolError "invalid_arguments") rather than sent as null as JSON.stringify would.
import net from "node:net";

const SOCKET_PATH = "/run/ptc/tools.sock";
const uncurryThis = Function.prototype.bind.bind(Function.prototype.call); // f(x, ...a) calls x.f(...a), once bound
const { parse: JSONParse, stringify: JSONStringify } = JSON;
const { isSafeInteger, isFinite } = Number;
const { hasOwn, setPrototypeOf } = Object;
const isArray = Array.isArray;
const SafeBigInt = BigInt;
const SafeString = String;
const SafePromise = Promise;
const SafeMap = Map;
const SafeTypeError = TypeError;
const MathRandom = Math.random;
const DateNow = Date.now;
const charCodeAt = uncurryThis(String.prototype.charCodeAt);
const indexOf = uncurryThis(String.prototype.indexOf);
const slice = uncurryThis(String.prototype.slice);
const startsWith = uncurryThis(String.prototype.startsWith);
const numberToString = uncurryThis(Number.prototype.toString);
const bigIntToString = uncurryThis(BigInt.prototype.toString);
const mapGet = uncurryThis(Map.prototype.get);
const mapSet = uncurryThis(Map.prototype.set);
const mapDelete = uncurryThis(Map.prototype.delete);
const mapSize = uncurryThis(Object.getOwnPropertyDescriptor(Map.prototype, "size").get);
const mapForEach = uncurryThis(Map.prototype.forEach);
const mapClear = uncurryThis(Map.prototype.clear);
const createConnection = net.createConnection;
const { prototype: SocketPrototype } = net.Socket;
const socketOn = uncurryThis(SocketPrototype.on);
const socketWrite = uncurryThis(SocketPrototype.write);
const socketRef = uncurryThis(SocketPrototype.ref);
const socketUnref = uncurryThis(SocketPrototype.unref);
const socketSetEncoding = uncurryThis(SocketPrototype.setEncoding);
const socketDestroy = uncurryThis(SocketPrototype.destroy);

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

const randomTag = () => "\u0000ptc-" + numberToString(MathRandom(), 36) + "-" + numberToString(DateNow(), 36) + ":";
const isDigit = (code) => code >= 48 && code <= 57;
const SAFE_DIGITS = 15; // an integer of at most 15 digits is always safe: only longer ones are looked at

export function parseExact(text) {
  // JSON.parse, except that an integer beyond the safe range becomes a BigInt (exact) instead of a rounded Number.
  // The text is scanned once: strings are skipped whole (escapes included), numbers read to their end.
  let marked = "";
  let last = 0;
  let tag = null;
  const n = text.length;
  for (let i = 0; i < n; i++) {
    const code = charCodeAt(text, i);
    if (code === 34) {
      for (i++; i < n; i++) {
        const inner = charCodeAt(text, i);
        if (inner === 92) i++;
        else if (inner === 34) break;
      }
    } else if (code === 45 || isDigit(code)) {
      let end = code === 45 ? i + 1 : i;
      while (end < n && isDigit(charCodeAt(text, end))) end++;
      const next = end < n ? charCodeAt(text, end) : 0;
      const integer = next !== 46 && next !== 101 && next !== 69; // no ".", "e", "E" follows
      if (integer && end - i > SAFE_DIGITS && !isSafeInteger(+slice(text, i, end))) {
        tag ??= randomTag();
        marked += slice(text, last, i) + JSONStringify(tag + slice(text, i, end));
        last = end;
      }
      while (end < n && (isDigit(charCodeAt(text, end)) || indexOf(".eE+-", slice(text, end, end + 1)) >= 0)) end++;
      i = end - 1;
    }
  }
  if (tag === null) return JSONParse(text);
  marked += slice(text, last);
  return JSONParse(marked, (key, value) =>
    typeof value === "string" && startsWith(value, tag) ? SafeBigInt(slice(value, tag.length)) : value,
  );
}

export function stringifyExact(value) {
  // JSON.stringify, with a BigInt written as its exact integer; NaN and the infinities refused (TypeError).
  let tag = null;
  const text = JSONStringify(value, (key, item) => {
    if (typeof item === "bigint") {
      tag ??= randomTag();
      return tag + bigIntToString(item);
    }
    if (typeof item === "number" && !isFinite(item)) throw new SafeTypeError(`${item} is not a JSON number`);
    return item;
  });
  if (tag === null) return text;
  const quoted = slice(JSONStringify(tag), 0, -1); // the tag as it appears in the JSON text, after its opening quote
  let out = "";
  let last = 0;
  for (let at = indexOf(text, quoted); at >= 0; at = indexOf(text, quoted, last)) {
    const digits = at + quoted.length;
    const end = indexOf(text, '"', digits);
    out += slice(text, last, at) + slice(text, digits, end);
    last = end + 1;
  }
  return out + slice(text, last);
}

let socket = null;
let closedReason = null;
let nextId = 1;
let unread = "";
const pending = new SafeMap(); // id -> the resolve of its call's promise

function settle(resolve, reply) {
  // A reply object without a prototype: resolving a promise with it never looks up a `then` the script may have put
  // on Object.prototype.
  resolve(setPrototypeOf(reply, null));
}

function lost(reason) {
  if (closedReason === null) closedReason = reason;
  const waiting = [];
  mapForEach(pending, (resolve) => {
    waiting[waiting.length] = resolve;
  });
  mapClear(pending);
  for (let i = 0; i < waiting.length; i++) {
    settle(waiting[i], { ok: false, error: { type: "broker_unavailable", message: reason } });
  }
  if (socket !== null) socketUnref(socket);
}

function received(chunk) {
  let text = unread + chunk;
  for (let end = indexOf(text, "\n"); end >= 0; end = indexOf(text, "\n")) {
    const line = slice(text, 0, end);
    text = slice(text, end + 1);
    let reply;
    try {
      reply = parseExact(line);
    } catch (exc) {
      lost(`unreadable reply from the broker: ${exc}`);
      socketDestroy(socket);
      return;
    }
    if (reply === null || typeof reply !== "object" || !hasOwn(reply, "id")) continue;
    const resolve = mapGet(pending, reply.id);
    if (resolve === undefined) continue;
    mapDelete(pending, reply.id);
    settle(resolve, reply);
  }
  unread = text;
  if (mapSize(pending) === 0) socketUnref(socket);
}

function connect() {
  socket = createConnection(SOCKET_PATH);
  socketSetEncoding(socket, "utf8");
  socketUnref(socket);
  socketOn(socket, "data", received);
  socketOn(socket, "error", (exc) => lost(`cannot reach the broker at ${SOCKET_PATH}: ${exc.message}`));
  socketOn(socket, "close", () => lost("the broker closed the connection"));
}

export function request(body) {
  // Send one request; a promise of its reply object ({ok, result} or {ok: false, error}). Never rejects.
  let payload;
  try {
    payload = stringifyExact(body);
  } catch (exc) {
    const message = `arguments are not JSON-serializable: ${exc.message}`;
    return new SafePromise((resolve) => settle(resolve, { ok: false, error: { type: "invalid_arguments", message } }));
  }
  if (socket === null) connect();
  if (closedReason !== null) {
    const error = { type: "broker_unavailable", message: closedReason };
    return new SafePromise((resolve) => settle(resolve, { ok: false, error }));
  }
  const id = nextId++;
  return new SafePromise((resolve) => {
    mapSet(pending, id, resolve);
    socketRef(socket);
    socketWrite(socket, '{"id":' + id + "," + slice(payload, 1) + "\n");
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
  throw new ToolError(SafeString(error.type ?? "error"), SafeString(error.message ?? ""), tool);
}
