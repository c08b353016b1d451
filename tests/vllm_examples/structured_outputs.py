from enum import Enum

from pydantic import BaseModel

from minipaged import LLM, SamplingParams
from minipaged.sampling_params import StructuredOutputsParams

MAX_TOKENS = 100

by_choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
choice_prompt = "Classify this sentiment: the engine is wonderful!"

by_regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"],
                          max_tokens=MAX_TOKENS)
regex_prompt = "Generate an email address for Alan Turing, who works in Enigma. End in .com and new line. Example result: alan.turing@enigma.com\n"


class Kind(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"


class Car(BaseModel):
    brand: str
    model: str
    kind: Kind


by_json = SamplingParams(structured_outputs=StructuredOutputsParams(json=Car.model_json_schema()), max_tokens=MAX_TOKENS)
json_prompt = "Generate a JSON with the brand, model and kind of the most iconic car from the 90's"

SQL = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
by_grammar = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=SQL), max_tokens=MAX_TOKENS)
grammar_prompt = "Generate an SQL query to show the 'username' and 'email' from the 'users' table."


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512)
    for prompt, params in [(choice_prompt, by_choice), (regex_prompt, by_regex), (json_prompt, by_json),
                           (grammar_prompt, by_grammar)]:
        print(repr(llm.generate(prompt, params)[0].outputs[0].text))


if __name__ == "__main__":
    main()
