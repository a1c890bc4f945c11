"""A FastMCP server in code mode whose code runs in the service (docs/adapters/fastmcp.md)."""

import asyncio
import os

import fastmcp
from ptc_sandbox_client import AsyncClient
from ptc_sandbox_client.adapters.fastmcp import code_mode

client = AsyncClient(os.environ.get("PTC_URL", "http://127.0.0.1:8080"), os.environ.get("PTC_TOKEN"))
server = fastmcp.FastMCP("cities", transforms=[code_mode(client)])


@server.tool
def get_weather(city: str) -> dict[str, object]:
    """The weather of a city now."""
    return {"city": city, "temp_c": {"Oslo": 4, "Lima": 19}.get(city, 12)}


@server.tool
def get_timezone(city: str) -> str:
    """The IANA time zone of a city."""
    return {"Oslo": "Europe/Oslo", "Lima": "America/Lima"}.get(city, "UTC")


async def main() -> None:
    # A model connected to this server sees search, get_schema and execute; FastMCP's in-memory client plays it here.
    async with fastmcp.Client(server) as model:
        print(sorted(t.name for t in await model.list_tools()))  # ['execute', 'get_schema', 'search']
        code = "temps = {c: (await get_weather(city=c))['temp_c'] for c in ['Oslo', 'Lima']}\n"
        code += "return [max(temps, key=temps.get), await call_tool('get_timezone', {'city': 'Lima'})]"
        result = await model.call_tool("execute", {"code": code})
        print(result.content[0].text)  # ["Lima",{"result":"America/Lima"}]
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())  # or server.run(): serve it over stdio to any MCP client
