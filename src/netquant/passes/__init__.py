"""netquant.passes"""
