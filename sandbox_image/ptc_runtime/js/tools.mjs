// The tools object a script imports (`import tools from "tools"`), built from the manifest's tool names by the
// module the service generates per manifest (service/toolkit/js_stubs.py), which also names its exports.
//
// Every tool is an async function of one object of arguments, under its original name (`tools["get-user"]`,
// `tools["math.factorial"]`); a dotted name is also a path of namespaces (`tools.math.factorial`), each an object,
// or the function of the tool of that name when there is one (`tools.auth(...)` and `tools.auth.login(...)`). The
// object and its functions are frozen: a script cannot replace a tool for the rest of its own run by accident.
import { call, ToolError } from "./client.mjs";

function define(target, key, value) {
  // An own, enumerable member: defined, not assigned, so that a namespace member named like one of
  // Function.prototype's ("caller", "arguments", "toString") lands on the function instead of hitting the prototype's
  // accessor (which throws in strict mode) or being shadowed. No member is named "then": an object with a then
  // method is a thenable, which `await` and a promise's resolution would call (a tool named "then" is not reachable;
  // "x.then" is, by its full name).
  if (key === "then") return;
  Object.defineProperty(target, key, { value, writable: true, enumerable: true, configurable: true });
}

function stub(name) {
  const fn = async (args) => call(name, args);
  Object.defineProperty(fn, "name", { value: name });
  return fn;
}

export function makeTools(names) {
  const tools = {};
  const stubs = new Map(names.map((name) => [name, stub(name)]));
  for (const [name, fn] of stubs) define(tools, name, fn);
  for (const name of names) {
    const parts = name.split(".");
    if (parts.length < 2 || parts.some((part) => part === "")) continue;
    let node = tools;
    for (let i = 0; i < parts.length - 1; i++) {
      const part = parts[i];
      if (part === "then") {
        node = null; // no namespace of that name (``define``)
        break;
      }
      if (!Object.hasOwn(node, part)) {
        define(node, part, stubs.get(parts.slice(0, i + 1).join(".")) ?? {});
      } else if (typeof node[part] !== "object" && typeof node[part] !== "function") {
        node = null;
        break;
      }
      node = node[part];
    }
    const last = parts[parts.length - 1];
    if (node !== null && !Object.hasOwn(node, last)) define(node, last, stubs.get(name));
  }
  const freeze = (value) => {
    if ((typeof value === "object" || typeof value === "function") && !Object.isFrozen(value)) {
      Object.freeze(value);
      for (const key of Object.keys(value)) freeze(value[key]);
    }
  };
  freeze(tools);
  return tools;
}

export { ToolError };
